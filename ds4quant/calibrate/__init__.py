"""``ds4quant calibrate``: run token sequences through the layer-streamed
reference model and write the calibration files (``ds4quant.calib``):
imatrix, routing profile, sensitivity.

- ``stage``: the run (options, the files, the report);
- ``walk``: the layer walk (hidden streams in the work folder, branches);
- ``collect``: the per-layer sums the hooks record;
- ``sensitivity``: the sensitivity methods (streamed probes, per-tensor);
- ``experts``: routed-expert math (weights, seeded noise, perturbed experts);
- ``journal``: the work folder and the resume policy;
- ``model``: the streamed model on a device.

    rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "out/calib")
"""

from ds4quant.calibrate.sensitivity import Method
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
    "CalibrationReport", "Method", "calibrate", "read_tokens", "REPORT_SCHEMA", "REPORT_VERSION", "IMATRIX_FILE",
    "IMATRIX_LUCEBOX_FILE", "ROUTING_CSV", "ROUTING_JSON", "REPORT_FILE", "SENSITIVITY_SEQS",
]
