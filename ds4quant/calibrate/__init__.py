"""``ds4quant calibrate``: run token sequences through the reference model and
write the calibration files (``ds4quant.calib``): imatrix, routing profile,
sensitivity.

- ``stage``: the run (reference model, hooks, worker processes, the files);
- ``sensitivity``: the sensitivity pass (perturb each routed-expert tensor,
  measure the KL it costs).

    rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "out/calib")
"""

from ds4quant.calibrate.stage import (
    IMATRIX_FILE,
    IMATRIX_LUCEBOX_FILE,
    REPORT_FILE,
    REPORT_SCHEMA,
    REPORT_VERSION,
    ROUTING_CSV,
    ROUTING_JSON,
    SENSITIVITY_SEQS,
    CalibrationReport,
    calibrate,
    read_tokens,
)

__all__ = [
    "CalibrationReport", "calibrate", "read_tokens", "REPORT_SCHEMA", "REPORT_VERSION", "IMATRIX_FILE",
    "IMATRIX_LUCEBOX_FILE", "ROUTING_CSV", "ROUTING_JSON", "REPORT_FILE", "SENSITIVITY_SEQS",
]
