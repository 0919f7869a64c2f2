"""Deploying an artifact on a user's machines.

- ``place``: plan which owner (CPU, GPU, worker, cluster rank) holds which
  routed expert, from the artifact's expert bytes and a routing profile
  (``ds4quant place``); the placement record itself is the runtime's
  (``ds4quant.runtime.placement``).
"""
