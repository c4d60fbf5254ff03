"""Make ``qwen_style/``: a small byte-level BPE tokenizer laid out as Qwen ships its tokenizers.

    python tests/data/hf_tokenizer/make_tokenizer.py tests/data/hf_tokenizer/qwen_style

The same parts as Qwen3's ``tokenizer.json`` (NFC normalizer, Qwen's split pattern then byte-level
pre-tokenizer, byte-level decoder, BPE, ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>``
added as special tokens after the vocabulary) and ``tokenizer_config.json`` (Qwen2Tokenizer,
``eos_token`` ``<|endoftext|>`` as in the Qwen3 base models, no BOS), trained on
``tests/data/prepare/small.jsonl`` with a 400-entry vocabulary (kilobytes, not Qwen's 7 MB).
"""

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def main(out: Path) -> None:
    corpus = Path(__file__).resolve().parents[1] / "prepare" / "small.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(SPECIALS)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    first = tok.token_to_id(SPECIALS[0])
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                                              "rstrip": False, "single_word": False, "special": True}
                                 for t in SPECIALS},
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: vocabulary {tok.get_vocab_size(with_added_tokens=True)}, <|endoftext|> = {first}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
