"""Child process of test_memory: a streamed run under a --max-memory budget,
printing one JSON line with its peak RSS, so the parent measures this run alone.

Peak RSS is the kernel's high-water mark of this process (VmHWM), not
ru_maxrss: on Linux a child's ru_maxrss starts from its parent's RSS at fork.
The budget bounds what the run holds beyond the process's own footprint
(Python, torch, transformers and numba loaded: 0.45-0.6 GB, which varies from
one install to another), so that footprint is read before the run starts."""

import json
import sys

import numpy as np


def _vm_hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(src: str, budget: str, work: str) -> None:
    from ds4quant.runtime.reference import torch_threads
    from ds4quant.runtime.stream import SourceWeights, StreamedModel, plan_memory, stream_forward

    import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401  (part of the footprint)

    import ds4quant.formats.fp8  # noqa: F401

    base = _vm_hwm()
    rng = np.random.default_rng(1)
    with SourceWeights(src) as w, torch_threads(1):
        sm = StreamedModel(w)
        seqs = [[int(t) for t in rng.integers(3, w.config.vocab_size, 64)] for _ in range(4)]
        batches = sm.batches(seqs)
        plan = plan_memory(w, [b.shape for b in batches], budget)
        sums = []

        class Keep:
            def on_logits(self, index, batch, logits):
                sums.append(float(logits.double().sum()))

        from ds4quant.runtime.stream import Observer

        obs = type("O", (Observer,), {"on_logits": Keep.on_logits})()
        stream_forward(sm, batches, plan=plan, work_dir=work, observer=obs, keep_logits=False)
    rss = _vm_hwm()
    print(json.dumps({"peak_rss": rss, "base_rss": base, "plan": plan.to_json(), "sums": sums}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
