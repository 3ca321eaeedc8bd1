"""The ``merit`` command: the face over the library (``pipeline``, ``calibration``), the Prefect
flows (``flows``) and the ``merit bench`` measurements (``merit.bench``). Nothing below it imports it."""
