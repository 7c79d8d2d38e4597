"""Calibration: running the engine (rapidmoe.Llama) over text or a load to choose parameters for the layers below.

- imatrix.py: importance-matrix collection for RESplit conversion (collect_imatrix; files: resplit/imatrix.py)
- measure.py: the UMIA latency model measured on this machine (calibrate-latency), and its device part priced
  from a machine profile or measured on a device
- umia.py: UMIA policy calibration: the accuracy-latency frontier of candidate policies on text, and a choice

Layer: above the engine (rapidmoe.llama, which these run) and below the server and CLI; rapidmoe.umia keeps the
policy and its cost models, which the engine imports. The modules import without a build: the engine is imported
where it runs.
"""
