"""A tiny, weightless model directory for Dynamo's mocker engine and frontend.

`python -m dynamo.mocker --model-path DIR` and the frontend it registers with read only
``config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with a chat template); no
weights are loaded. No model hub is reachable from the test machines, so the tokenizer is trained
here, offline, on a generated corpus. The mocker emits token ids around 1000-1999, so the vocabulary
must hold at least 2048 ids or detokenisation fails: the corpus yields about 2500.

Needs the ``tokenizers`` package (part of the ``dynamo`` wheelhouse set), so run it with the Dynamo
venv's interpreter: ``PYTHONPATH=<repo> <venv>/bin/python -m k31deploy.tinymodel DIR NAME``.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MIN_VOCAB = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
# ChatML, the template shape the Kimi and Qwen families use.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SYLLABLES = [
    "ka",
    "ri",
    "mo",
    "ten",
    "lu",
    "sha",
    "vor",
    "ne",
    "qui",
    "bel",
    "dra",
    "po",
    "zin",
    "fe",
    "gul",
]


def _corpus() -> list[str]:
    # Every two- and three-syllable word: enough distinct pairs for BPE to learn > MIN_VOCAB merges.
    words = ["".join(p) for n in (2, 3) for p in itertools.product(_SYLLABLES, repeat=n)]
    return [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MIN_VOCAB + 512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() < MIN_VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tokenizer.get_vocab_size()} ids, the mocker needs {MIN_VOCAB}")
    return tokenizer


def write_tiny_model(directory: str | Path, name: str) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json for model `name` into `directory`."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(target / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = {
        "_name_or_path": name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<pad>"],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m k31deploy.tinymodel DIR NAME", file=sys.stderr)
        return 2
    print(write_tiny_model(args[0], args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
