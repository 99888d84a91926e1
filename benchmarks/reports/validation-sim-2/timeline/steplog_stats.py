# Per-process pass statistics of a sim cluster's step log (steplog.patch, PDSERVE_SIM_STEPLOG=steplog/s):
# columns: forward start, forward end (wall s), decoding sequences, prefill items, prefill tokens so far,
# modelled pass time (profile s). usage: python steplog_stats.py SPEEDUP steplog/s.*
import sys

import numpy as np

K = float(sys.argv[1])
for f in sorted(sys.argv[2:]):
    a = np.loadtxt(f)
    st, en, nd, npf, _, sec = a.T
    over = (en - st) - sec / K  # wall time past the modelled end of the pass (late wake-up)
    gap = st[1:] - en[:-1]
    print(f, 'passes', len(a), 'mean dec batch %.1f' % nd.mean(), 'mean pf items %.2f' % npf.mean(),
          'modelled wall ms %.1f' % (sec.mean() / K * 1000),
          'oversleep ms mean %.1f p99 %.1f' % (over.mean() * 1000, np.percentile(over, 99) * 1000))
    if len(a) > 100:
        busy = gap < 0.5 * (sec[1:].mean() / K)
        g = gap[busy] * 1000
        b = nd[1:][busy] + npf[1:][busy]
        fit = np.linalg.lstsq(np.vstack([np.ones_like(b), b]).T, g, rcond=None)[0]
        print('  gaps between passes (busy) wall ms mean %.1f median %.1f p90 %.1f p99 %.1f; fit %.2f + %.3f*n'
              % (g.mean(), np.median(g), np.percentile(g, 90), np.percentile(g, 99), *fit))
        iv = np.diff(st)[nd[:-1] > 0] * K * 1000
        print('  decode step interval profile ms mean %.2f p90 %.2f p99 %.2f' % (iv.mean(), *np.percentile(iv, [90, 99])))
