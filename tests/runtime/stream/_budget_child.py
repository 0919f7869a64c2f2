"""Child process of test_memory: a streamed run under a --max-memory budget,
printing one JSON line with its peak RSS (ru_maxrss), so the parent measures
this run alone."""

import json
import resource
import sys

import numpy as np


def main(src: str, budget: str, work: str) -> None:
    from ds4quant.runtime.reference import torch_threads
    from ds4quant.runtime.stream import SourceWeights, StreamedModel, plan_memory, stream_forward

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
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": rss, "plan": plan.to_json(), "sums": sums}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
