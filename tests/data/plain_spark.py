"""A Horovod job on Spark that knows nothing of hvtrace: ``horovod.spark.run`` runs a training
function (``plain_train.train``) in the tasks of a local Spark (``local[N]``) this driver starts.
Tests trace it by environment alone: Spark's Python workers inherit the driver's environment
(``$HVTRACE_DIR``) through its JVM, and Horovod's task services pass it on to the ranks.

``--slow-rank R --slow-ms MS`` makes rank R sleep MS in its forward each step.
"""

import os
import sys

import horovod.spark
from plain_train import driver_args, on_workers_path, train
from pyspark.sql import SparkSession

args = driver_args()

on_workers_path()
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers run this Python
spark = SparkSession.builder.master(f"local[{args.np}]").appName("plain_spark").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
losses = horovod.spark.run(
    train, args=(args.steps, args.slow_rank, args.slow_ms), num_proc=args.np, use_gloo=True
)
spark.stop()
print("losses", losses)
