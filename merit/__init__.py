"""The ``merit`` command: the face over the library (``pipeline``, ``calibration``), the Prefect
flows (``flows``) and the benchmarks (``benchmarks``). Nothing below it imports it."""
