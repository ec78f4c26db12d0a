"""Workers: what computes (sim, local torch) and where it runs (in-process threads, Ray actors),
behind the protocols in backends/protocols.py. Workers receive only `SampleRequest`, `Weights`
and `TrainBatch`; nothing here imports the orchestrator or its stages."""
