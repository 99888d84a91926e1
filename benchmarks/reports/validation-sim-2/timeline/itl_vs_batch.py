# Measured ITL vs the number of decoding requests per decode worker (client records only).
# usage: python itl_vs_batch.py results.json [all]
import json, sys, numpy as np
d = json.load(open(sys.argv[1]))
K = d['bench']['speedup']
for p in d['points']:
    if p['decode'] != 1 and p['colocated'] == 0 and 'all' not in sys.argv: continue
    recs = [r for r in p['records'] if not r['error']]
    # token times
    evs = []
    for r in recs:
        t = r['send_time'] + r['ttft']
        times = [t]
        for g in r['itl']:
            t += g; times.append(t)
        r['_times'] = times
    starts = np.array([r['_times'][0] for r in recs]); ends = np.array([r['_times'][-1] for r in recs])
    xs, ys = [], []
    for r in recs:
        ts = r['_times']
        for a, b in zip(ts, ts[1:]):
            mid = (a+b)/2
            xs.append(((starts <= mid) & (ends >= mid)).sum()); ys.append((b-a)*1000)
    xs, ys = np.array(xs), np.array(ys)
    # per decode worker batch approx = active / n_decode
    nd = p['decode'] or p['colocated']
    b = xs / nd
    A = np.vstack([np.ones_like(b), b]).T
    coef = np.linalg.lstsq(A, ys, rcond=None)[0]
    # model ITL without overhead: a + b*B + c*ctx (approx ctx ~ 600*B)
    model = 6.36 + 0.04*b + 5.2e-5*600*b
    ex = ys - model
    c2 = np.linalg.lstsq(A, ex, rcond=None)[0]
    print(p['config'], p['rate'], 'mean batch/worker %.1f' % b.mean(), 'ITL ms=%.2f+%.3f*B' % tuple(coef),
          'excess(profile ms)=%.2f+%.3f*B' % tuple(c2), 'wall ms: %.1f + %.2f*B' % (c2[0]/K, c2[1]/K))
