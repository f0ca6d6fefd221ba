"""A tiny, weightless model directory for the sandbox's Dynamo workers and the frontend.

The Dynamo worker stand-in (k31deploy.standin.dynamo) registers this directory with
``dynamo.llm.register_model``; the frontend reads only ``config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with a chat template) from it, to render prompts into token ids and
detokenise the worker's ids; no weights are loaded. No model hub is reachable from the test machines,
so the tokenizer is trained here, offline, on a generated corpus that holds every word the stand-in
answers with (k31deploy.standin.replies.VOCAB), so each of its words is one token, as the stand-in's
timing model counts them, and Kimi K3's XTML markers are single tokens too.

Needs the ``tokenizers`` package (part of the ``dynamo`` wheelhouse set), so run it with the Dynamo
venv's interpreter: ``PYTHONPATH=<repo> <venv>/bin/python -m k31deploy.tinymodel DIR NAME``.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k31deploy.standin.replies import VOCAB

# Room for the syllable words' merges and the stand-in's words (build_tokenizer checks that each is one token).
VOCAB_SIZE = 2560
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
# Kimi K3's XTML markers (k31deploy.standin.dynamo.reply_pieces), one token each. Not special tokens: the
# frontend detokenises without them, and its kimi_k3 parsers must see the markers in the text.
XTML_TOKENS = ["<|open|>", "<|close|>", "<|sep|>"]
XTML_TAGS = ("think", "response", "tools", "call", "json")
# ChatML, the template shape the Kimi and Qwen families use. The request's tools and reasoning_effort are
# rendered into the prompt as a Kimi template renders them, since the prompt's token ids are all a Dynamo
# worker receives: the stand-in worker reads them back to answer as the SGLang stand-in does.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if reasoning_effort %}<|im_start|>reasoning_effort\n{{ reasoning_effort }}<|im_end|>\n{% endif %}"
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
    # Every two- and three-syllable word: varied text, so prompts are not all one or two tokens.
    words = ["".join(p) for n in (2, 3) for p in itertools.product(_SYLLABLES, repeat=n)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    # The stand-in's words, often enough that BPE merges each one, each also first on a line (the first word
    # of an answer has no leading space).
    words = (*VOCAB, *XTML_TAGS)
    rotations = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines + rotations * 20


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens(XTML_TOKENS)
    split = [w for w in (*VOCAB, *(f" {v}" for v in VOCAB), *XTML_TOKENS) if len(tokenizer.encode(w).ids) != 1]
    if split:
        raise RuntimeError(f"the tiny tokenizer splits {split[:5]}: the stand-in counts each as one token")
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
