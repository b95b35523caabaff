"""Write the smallest ``llama``-architecture GGUF that llama.cpp loads: a test helper.

Run with the Python that has ``gguf`` (the separate llama venv, not the project's):
``python tests/tiny_gguf.py PATH``. About 260 KB: one layer, 64-wide, a SentencePiece-style
vocabulary of the three special tokens, the 256 byte tokens (so any prompt tokenizes) and
sixteen words. The layer's weights are zero, so each step's logits depend on the last
token alone, and the output weights keep every token but the words out of reach: the
answer is gibberish made of whole words, never an end-of-sequence token, so a call always
runs to its ``max_tokens``, and never a stray byte that would make invalid UTF-8.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

WORDS = ("hello", "world", "tiny", "model", "proxy", "queue", "slot", "tier",
         "fast", "slow", "first", "next", "token", "call", "wait", "done")
EMBED, HEADS, FFN, CONTEXT = 64, 2, 64, 512
# No special tokens in it, so any tokenizer reads it the same; the end-of-sequence token
# is the stop the server adds.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += ["\u2581" + word for word in WORDS]  # SentencePiece's word-start mark
    types += [gguf.TokenType.NORMAL] * len(WORDS)
    scores = [0.0] * (len(tokens) - len(WORDS)) + [-1.0] * len(WORDS)
    return tokens, scores, [int(t) for t in types]


def write(path: str) -> None:
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(21)
    vocab = len(tokens)
    words = np.array([t == gguf.TokenType.NORMAL for t in types])
    # Dimension 0 is a constant 1 in every embedding; the output rows weigh it +3 for the
    # words and -30 for everything else, which the other (random) dimensions cannot undo.
    embed = rng.normal(0.0, 0.5, (vocab, EMBED)).astype(np.float32)
    embed[:, 0] = 1.0
    output = rng.normal(0.0, 1.0, (vocab, EMBED)).astype(np.float32)
    output[:, 0] = np.where(words, 3.0, -30.0)
    ones = np.ones(EMBED, dtype=np.float32)

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("triage-proxy tiny test model")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    # numpy shapes are ggml's reversed: (out, in) for a matrix.
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", output)
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", zeros(EMBED, EMBED))
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_gate.weight", zeros(FFN, EMBED))
    writer.add_tensor("blk.0.ffn_up.weight", zeros(FFN, EMBED))
    writer.add_tensor("blk.0.ffn_down.weight", zeros(EMBED, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    write(sys.argv[1])
