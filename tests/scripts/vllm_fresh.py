"""In the vLLM environment: a fresh engine started on each Hugging Face folder given, asked the
greedy tokens and top logprobs of push_fsdp.py's prompts; written to OUT as the server's
completions answer them (tokens as ``token_id:N``), one record per folder.

    vllm_fresh.py OUT FOLDER... [--push STEP]

``--push STEP``: the first folder's engine (in this process) then takes the weights of the
checkpoint step STEP (``dcpkit.push.checkpoint.push_checkpoint``, TorchTitan names through the
llama3 key map) and answers again: the record ``pushed``.
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams
from vllm.config import WeightTransferConfig
from vllm.inputs import TokensPrompt

from dcpkit.push.checkpoint import push_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [300, 11, 200, 42]]


def answers(llm: LLM) -> list:
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    outputs = []
    for a in llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params):
        c = a.outputs[0]
        tokens = [f"token_id:{t}" for t in c.token_ids]
        top = [{f"token_id:{k}": v.logprob for k, v in lp.items()} for lp in c.logprobs]
        outputs.append([tokens, top])
    return outputs


def main() -> None:
    args = sys.argv[1:]
    step = None
    if "--push" in args:
        at = args.index("--push")
        step, args = args[at + 1], args[:at] + args[at + 2 :]
    out, folders = args[0], args[1:]
    records = []
    for i, folder in enumerate(folders):
        llm = LLM(folder, dtype="float32", enforce_eager=True, max_model_len=256,
                  weight_transfer_config=WeightTransferConfig(backend="dcpkit_gloo"))  # fmt: skip
        records.append({"folder": folder, "outputs": answers(llm)})
        if i == 0 and step is not None:
            result = push_checkpoint(step, llm, bucket_size="1MB")
            version = llm.get_weight_version()
            records.append({"pushed": step, "version": version, "buckets": result.buckets,
                            "outputs": answers(llm)})  # fmt: skip
        del llm
        gc.collect()
    with open(out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
