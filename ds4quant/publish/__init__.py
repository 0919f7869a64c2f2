"""``ds4quant publish``: a verified artifact -> a release folder anyone can check.

- ``release``: verify, copy the artifact, write the report and the card,
  SHA256SUMS, upload;
- ``report``: the verify report for people (report.md, verify.json, PNG plots);
- ``card``: the model card (the release's README.md).

    rel = publish("out/tiny-mix", "release/tiny-mix", source="samples/ds4-tiny")
"""

from ds4quant.publish.card import model_card, runtimes
from ds4quant.publish.release import HubError, PublishReport, UnsoundArtifactError, check_hf_repo, publish

__all__ = ["publish", "PublishReport", "UnsoundArtifactError", "HubError", "check_hf_repo", "model_card", "runtimes"]
