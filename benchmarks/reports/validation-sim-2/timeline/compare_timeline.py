# Timeline comparison: the simulator's decode passes vs the sim engine's step log for one point.
# usage (from this folder, after `tar xzf steplog.tar.gz` and `gunzip -k results.json.gz`):
#   PYTHONPATH=<repo>:<repo>/proto python compare_timeline.py PROFILE.json [PROFILE2.json ...]
import json, sys, numpy as np
from pdserve.capacity import simulator as S
from pdserve.capacity.planner import validate, timing_for, sweep_prompts
from pdserve.engine.sim_profile import load_profile
K = 0.05
log = []
orig_run = S._Loop._run_pass
def run_pass(self, seconds, n, then):
    log.append((type(self).__name__, self.loop.now, seconds, n, len(getattr(self, 'running', []))))
    return orig_run(self, seconds, n, then)
S._Loop._run_pass = run_pass
sweep = json.load(open('results.json'))
for prof in sys.argv[1:]:
    log.clear()
    validate(timing_for(load_profile(prof)), sweep, sweep_prompts(sweep))
    dec = [l for l in log if l[0] == '_EngineWorker']
    pf = [l for l in log if l[0] == '_PrefillWorker']
    n = np.array([l[3] for l in dec]); t = np.array([l[1] for l in dec])
    print(prof.split('/')[-1], 'sim decode passes', len(dec), 'mean seqs/pass %.1f' % n.mean(), 'max %d' % n.max(),
          'mean interval ms %.2f' % (np.diff(t).mean()*1000), 'prefill passes', len(pf))
a = np.loadtxt('steplog/s.947'); st, en, nd, npf, _, sec = a.T
print('measured decode passes', len(a), 'mean seqs/pass %.1f' % (nd+npf).mean(), 'max %d' % nd.max(),
      'mean interval ms %.2f (profile)' % (np.diff(st).mean()*1000*K))
