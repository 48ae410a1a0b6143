"""hvtrace's trace format, below everything else: the schema (:mod:`hvtrace.format.schema`) and
the records a batch status carries with their merges (:mod:`hvtrace.format.status`).

The recorder writes through it and the reader reads through it; nothing here imports the
recorder, the reader's run model or the analysis. (Reading streams and Parquet files and
compaction join it in the next steps of issue 42.)
"""
