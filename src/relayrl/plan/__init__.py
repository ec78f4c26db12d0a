"""`relayrl plan`: predict a run before paying for it (docs/design.md, "Planning a run").

A cost model is fitted from a measured run's trace, trajectories and metrics (`fit`, `source`),
with a resource model of which device each worker occupies and how workers sharing one slow each
other (`resources`); the real orchestrator then runs on modelled workers (`workers`) under the
changed configuration, several seeds (`predict`); `sweep` tabulates and plots one key, `check`
measures the prediction's error against the run that followed, `bench` runs the whole loop on
real torch runs.
"""
