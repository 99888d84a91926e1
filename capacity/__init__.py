"""Capacity experiments: a load generator (`bench`), prefill:decode sweeps (`sweep`) and a
DistServe-style planner (`planner`: profile, simulate, validate).

Modules: ``metrics`` (pure metric math, vLLM `bench serve` definitions), ``arrivals`` (request
timing), ``workload`` (length distributions, built-in corpus, prompt cutting), ``bench`` (the
asyncio gRPC client), ``sweep`` (xPyD vs colocated over rates), ``plots``, ``profiler`` (in-process
latency fits), ``simulator`` (discrete-event model of router + pools), ``planner`` (search and
validation), ``cli`` (the `pdserve bench|sweep|plan` subcommands).

Invariants: metric math never touches the network or a clock; everything random takes a seed;
nothing is pickled (results are JSON/CSV).
"""
