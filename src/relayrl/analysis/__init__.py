"""Reading a finished or running run offline: the trace's timeline, the trace checker, the report
(plots, HTML page) and the runs list. Read-only on run directories; the orchestrator imports only
the timeline (for summary.json)."""
