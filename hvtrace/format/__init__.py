"""hvtrace's trace format, below everything else: the schema (:mod:`hvtrace.format.schema`), the
records a batch status carries and their merges (:mod:`hvtrace.format.status`), reading one rank
file in either form (:mod:`hvtrace.format.read`) and compacting a closed stream into Parquet
(:mod:`hvtrace.format.compact`).

The recorder writes through it and the reader reads through it; nothing here imports the
recorder, the run model (:mod:`hvtrace.load`) or the analysis.
"""
