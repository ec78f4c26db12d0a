"""Workers: what computes (a compute kind: sim, local torch) and where it runs (a host: in-process
threads, Ray actors), chosen once by `registry.py`, behind the protocols in `protocols.py`. Workers
receive only `SampleRequest`, `Weights` and `TrainBatch`; nothing here imports the orchestrator."""
