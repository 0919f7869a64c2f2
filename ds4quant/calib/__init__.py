"""Calibration files: what ``ds4quant calibrate`` writes and convert, place and
the runtime read. One module per file format:

- ``routing``: routing profiles (Lucebox hotness CSV, ds4quant JSON);
- ``imatrix``: importance matrices (GGUF imatrix, llama.cpp imatrix.dat, the
  Lucebox converter layout);
- ``sensitivity``: ``sensitivity.json``, KL per unit of weighted error per
  routed-expert tensor.

These are file formats only (the artifact layer): measuring them is the
calibrate stage's (``ds4quant.calibrate``).
"""
