# The shapes of the per-pass randomness, from the step log of validation-sim-2/timeline/ (5P1D at 80 req/s,
# K = 0.05; its busy decode worker is the file with most passes).
# usage: python shapes_from_steplog.py 0.05 steplog/s.947
# * wake_sigma: a lognormal of mean m and median m exp(-s^2/2) through the late ends of the worker's sleeps;
# * jitter_sigma: the spread (coefficient of variation) of the gap between passes around its fit a + b n,
#   as a lognormal factor of mean 1: s = sqrt(ln(1 + cv^2)).
import sys

import numpy as np

K = float(sys.argv[1])
st, en, nd, npf, _, sec = np.loadtxt(sys.argv[2]).T
late = (en - st) - sec / K
m, med = late.mean(), np.median(late)
s = np.sqrt(2 * np.log(m / med))
p99, model_p99 = np.percentile(late, 99), m * np.exp(2.326 * s - s * s / 2)
print(f'late wake-up wall ms: mean {m * 1e3:.2f} median {med * 1e3:.2f} p99 {p99 * 1e3:.1f} '
      f'-> wake_sigma {s:.2f} (its p99: {model_p99 * 1e3:.1f} ms)')
gap = st[1:] - en[:-1]
busy = gap < 0.5 * (sec[1:].mean() / K)
g, n = gap[busy], (nd[1:] + npf[1:])[busy]
a, b = np.linalg.lstsq(np.vstack([np.ones_like(n), n]).T, g, rcond=None)[0]
r = g / (a + b * n)
cv = r.std() / r.mean()
print(f'gap between passes: {a * 1e3:.2f} + {b * 1e3:.3f} ms x n, spread cv {cv:.2f} '
      f'-> jitter_sigma {np.sqrt(np.log(1 + cv * cv)):.2f}')
