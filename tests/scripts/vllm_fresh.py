"""In the vLLM environment: a fresh engine started on each Hugging Face folder given, asked the
greedy tokens and top logprobs of push_fsdp.py's prompts; written to OUT as the server's
completions answer them (tokens as ``token_id:N``), one record per folder.

    vllm_fresh.py OUT FOLDER...
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [300, 11, 200, 42]]


def main() -> None:
    out, folders = sys.argv[1], sys.argv[2:]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    records = []
    for folder in folders:
        llm = LLM(folder, dtype="float32", enforce_eager=True, max_model_len=256)
        answers = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
        outputs = []
        for a in answers:
            c = a.outputs[0]
            tokens = [f"token_id:{t}" for t in c.token_ids]
            top = [{f"token_id:{k}": v.logprob for k, v in lp.items()} for lp in c.logprobs]
            outputs.append([tokens, top])
        records.append({"folder": folder, "outputs": outputs})
        del llm, answers
        gc.collect()
    with open(out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
