"""TRL's real GRPOTrainer on the CPU, its colocated vLLM a recording stand-in; run alone.

``python tests/trl_grpo_run.py FAKE_DIR SCENARIO`` writes a stand-in ``vllm`` package
into FAKE_DIR (TRL imports ``LLM``, ``SamplingParams`` and a few helpers from it; the
stand-in's ``LLM`` records every call and answers ``generate`` with fixed tokens), puts
it first on ``sys.path``, builds a one-layer Llama and a word-level tokenizer in a
temporary folder, and trains two steps of TRL's own GRPOTrainer
(``use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True``, accelerate on the
CPU) with hybridmem's drop-in around it. It prints one JSON line: the engine calls in
order, and what the scenario checks.

Scenarios: ``train`` (two steps, ``offload_optimizer=True``), ``fail`` (the engine's
second ``generate`` raises), ``fail-bare`` (the same, without the drop-in: TRL alone),
``docs`` (docs/backends/trl.md's block, run as written on the same model, with
``GRPOConfig``'s defaults for a two-step CPU run put in under it).
Needs trl 1.16.0 with its dependencies (CI's ``trl`` job).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

STAND_IN = {
    "vllm/__init__.py": '''
        """A recording stand-in of vLLM's LLM, as TRL's colocate mode calls it."""
        import types

        __version__ = "0.31.0"
        CALLS = []
        FAIL = {}


        class SamplingParams:
            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)


        class RequestOutput:
            pass


        class _Logprob:
            def __init__(self, logprob, rank):
                self.logprob, self.rank = logprob, rank


        class LLM:
            def __init__(self, **kwargs):
                CALLS.append(["LLM", kwargs.get("enable_sleep_mode")])
                model = types.SimpleNamespace(load_weights=self._load)
                runner = types.SimpleNamespace(model=model)
                worker = types.SimpleNamespace(model_runner=runner)
                self.llm_engine = types.SimpleNamespace(
                    model_executor=types.SimpleNamespace(driver_worker=worker)
                )

            def _call(self, *call):
                CALLS.append(list(call))
                counts = FAIL.get(call[0])
                if counts is not None:
                    counts[0] -= 1
                    if counts[0] == 0:
                        raise RuntimeError(f"stand-in: {call[0]} failed")

            def _load(self, weights):
                for name, _ in weights:
                    self._call("load_weights", name)

            def sleep(self, level=1):
                self._call("sleep", level)

            def wake_up(self, tags=None):
                self._call("wake_up", tags)

            def reset_prefix_cache(self):
                self._call("reset_prefix_cache")

            def generate(self, prompts, sampling_params=None, use_tqdm=True):
                self._call("generate", len(prompts))
                n = getattr(sampling_params, "n", 1)
                seq = lambda: types.SimpleNamespace(  # noqa: E731
                    token_ids=[5, 6, 7, 8],
                    logprobs=[{t: _Logprob(-0.5, 1)} for t in (5, 6, 7, 8)],
                )
                return [
                    types.SimpleNamespace(
                        prompt_token_ids=p["prompt_token_ids"], outputs=[seq() for _ in range(n)]
                    )
                    for p in prompts
                ]
    ''',
    "vllm/sampling_params.py": """
        class StructuredOutputsParams:
            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)
    """,
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": """
        def get_ip():
            return "127.0.0.1"
    """,
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/weight_transfer/__init__.py": "",
    "vllm/distributed/weight_transfer/nccl_common.py": "def trainer_init(*a, **k): ...\n",
    "vllm/distributed/weight_transfer/packed_tensor.py": (
        "def packed_nccl_broadcast_producer(*a, **k): ...\n"
    ),
    "vllm/distributed/weight_transfer/nccl_engine.py": (
        "class NCCLTrainerSendWeightsArgs: ...\nclass NCCLWeightTransferEngine: ...\n"
    ),
}


def write_stand_in(folder: Path) -> None:
    for name, text in STAND_IN.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def save_model(folder: Path) -> object:
    """A one-layer Llama and a word-level tokenizer saved in ``folder / "model"``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tokenizer_model = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer_model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_model, pad_token="<pad>", eos_token="<eos>"
    )
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return tokenizer


def build_trainer(folder: Path, max_steps: int) -> object:
    """TRL's GRPOTrainer over a one-layer Llama, as a GRPO user builds it."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = save_model(folder)
    args = GRPOConfig(
        output_dir=str(folder / "out"), use_vllm=True, vllm_mode="colocate",
        vllm_enable_sleep_mode=True, max_steps=max_steps, per_device_train_batch_size=2,
        num_generations=2, max_completion_length=4, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    return GRPOTrainer(
        model=str(folder / "model"),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7", "w9"] * 2}),
        processing_class=tokenizer,
    )


def run_doc_block(folder: Path) -> None:
    """docs/backends/trl.md's first Python block, on the model ``build_trainer`` saves."""
    import trl

    doc = (Path(__file__).resolve().parents[1] / "docs" / "backends" / "trl.md").read_text()
    block = re.search(r"```python\n(.*?)```", doc, re.DOTALL)
    assert block is not None, "docs/backends/trl.md has no Python block"
    save_model(folder)
    config = trl.GRPOConfig

    def cpu_run(*args: object, **kwargs: object) -> object:  # what a 2-step CPU run needs
        kwargs["output_dir"] = str(folder / "out")
        demo: dict[str, object] = {"max_steps": 2, "per_device_train_batch_size": 2}
        demo.update(num_generations=2, max_completion_length=4, use_cpu=True, bf16=False)
        demo["report_to"] = []
        return config(*args, **{**kwargs, **demo})

    trl.GRPOConfig = cpu_run
    names = {
        "model_name": str(folder / "model"),
        "reward": lambda completions, **kwargs: [float(len(c)) for c in completions],
        "dataset": __import__("datasets").Dataset.from_dict({"prompt": ["w1 w2", "w3"] * 4}),
    }
    exec(compile(block.group(1), "docs/backends/trl.md", "exec"), names)


def main() -> None:
    fake, scenario = Path(sys.argv[1]), sys.argv[2]
    write_stand_in(fake)
    sys.path.insert(0, str(fake))
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    import vllm  # the stand-in

    if scenario == "docs":
        with tempfile.TemporaryDirectory() as tmp:
            vllm.CALLS.clear()
            run_doc_block(Path(tmp))
        calls = [c for c in vllm.CALLS if c[0] != "load_weights"]
        print(json.dumps({"calls": calls}))
        return

    from hybridmem.integrations.trl import colocate

    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(Path(tmp), max_steps=2)
        generation = trainer.vllm_generation  # type: ignore[attr-defined]
        result["started_asleep"] = vllm.CALLS[-1] == ["sleep", 2]
        vllm.CALLS.clear()
        handle = (
            None
            if scenario == "fail-bare"
            else colocate(trainer, offload_optimizer=scenario == "train")
        )
        if scenario.startswith("fail"):
            vllm.FAIL["generate"] = [2]  # the second generation fails
        try:
            trainer.train()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            result["raised"] = str(exc)
            result["notes"] = getattr(exc, "__notes__", [])
        result["weights_stale"] = generation._llm_weights_sleeping
        optimizer = trainer.optimizer  # type: ignore[attr-defined]
        inner = getattr(optimizer, "optimizer", optimizer)
        result["optimizer"] = type(inner).__name__
        if handle is not None:
            result["awake"] = sorted(handle.awake)
            result["hooked"] = handle._hooked is inner
        result["state_tensors"] = sum(len(s) for s in inner.state.values())
        result["global_step"] = trainer.state.global_step  # type: ignore[attr-defined]
    result["calls"] = [c for c in vllm.CALLS if c[0] != "load_weights"]
    result["loads"] = sum(c[0] == "load_weights" for c in vllm.CALLS)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
