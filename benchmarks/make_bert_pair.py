"""Writes one random-weight BERT encoder twice: as a Hugging Face directory
(what `vellum serve` loads: safetensors, config.json, a WordPiece
tokenizer.json, sentence-transformers CLS pooling + Normalize) and as a GGUF
file (what llama.cpp's `llama-server --embedding` loads: its `bert`
architecture, tensor names and phantom-space WordPiece vocabulary, as its
converter writes them), with the same float32 weights, for
benchmarks/bert_embeddings_vs_llama_server.sh.

Usage: python3 make_bert_pair.py OUT_DIR [--hidden 384 --layers 12 --heads 12 --intermediate 1536]

The default shape is bge-small-en-v1.5's (33M parameters). The vocabulary
is the words of benchmarks/embeddings_client.py's corpus (every input
tokenizes to known words), after [PAD] [UNK] [CLS] [SEP] [MASK].
"""
import argparse
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".llama.cpp/src/vendor/llama.cpp/gguf-py"))
import gguf  # noqa: E402 (llama.cpp's own writer, from the vendored tree)

sys.path.insert(0, os.path.dirname(__file__))
from embeddings_client import WORDS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--positions", type=int, default=512)
    a = ap.parse_args()
    h, im, n_layers, n_pos = a.hidden, a.intermediate, a.layers, a.positions
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(w.lower() for w in WORDS)) + [".", ","]
    vocab = specials + words

    rng = np.random.default_rng(0)
    t = {}

    def rand(*shape, center=0.0, scale=0.05):
        return (center + rng.normal(0.0, scale, shape)).astype(np.float32)

    t["embeddings.word_embeddings.weight"] = rand(len(vocab), h)
    t["embeddings.position_embeddings.weight"] = rand(n_pos, h)
    t["embeddings.token_type_embeddings.weight"] = rand(2, h)
    t["embeddings.LayerNorm.weight"] = rand(h, center=1.0)
    t["embeddings.LayerNorm.bias"] = rand(h)
    for l in range(n_layers):
        p = f"encoder.layer.{l}."
        for name, out, inp in [("attention.self.query", h, h), ("attention.self.key", h, h), ("attention.self.value", h, h),
                               ("attention.output.dense", h, h), ("intermediate.dense", im, h), ("output.dense", h, im)]:
            t[p + name + ".weight"] = rand(out, inp)
            t[p + name + ".bias"] = rand(out)
        for name in ["attention.output.LayerNorm", "output.LayerNorm"]:
            t[p + name + ".weight"] = rand(h, center=1.0)
            t[p + name + ".bias"] = rand(h)

    hf = os.path.join(a.out, "hf")
    os.makedirs(os.path.join(hf, "1_Pooling"), exist_ok=True)
    save_file(t, os.path.join(hf, "model.safetensors"))
    json.dump({"architectures": ["BertModel"], "model_type": "bert", "vocab_size": len(vocab), "hidden_size": h,
               "num_hidden_layers": n_layers, "num_attention_heads": a.heads, "intermediate_size": im, "hidden_act": "gelu",
               "max_position_embeddings": n_pos, "type_vocab_size": 2, "layer_norm_eps": 1e-12}, open(os.path.join(hf, "config.json"), "w"))

    def special(i, c):
        return {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}

    def tok(i, ty):
        return {"SpecialToken": {"id": i, "type_id": ty}}

    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [special(i, c) for i, c in enumerate(specials)],
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True, "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [tok("[CLS]", 0), {"Sequence": {"id": "A", "type_id": 0}}, tok("[SEP]", 0)],
                           "pair": [tok("[CLS]", 0), {"Sequence": {"id": "A", "type_id": 0}}, tok("[SEP]", 0),
                                    {"Sequence": {"id": "B", "type_id": 1}}, tok("[SEP]", 1)],
                           "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                                              "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                  "vocab": {w: i for i, w in enumerate(vocab)}},
    }
    json.dump(tokenizer, open(os.path.join(hf, "tokenizer.json"), "w"))
    json.dump({"word_embedding_dimension": h, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
              open(os.path.join(hf, "1_Pooling", "config.json"), "w"))
    json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
              open(os.path.join(hf, "modules.json"), "w"))

    # The same weights as llama.cpp's converter writes a BertModel.
    path = os.path.join(a.out, "bert.gguf")
    w = gguf.GGUFWriter(path, "bert")
    w.add_context_length(n_pos)
    w.add_embedding_length(h)
    w.add_feed_forward_length(im)
    w.add_block_count(n_layers)
    w.add_head_count(a.heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.CLS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_token_type_count(2)
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * len(words)
    phantom = [t_ if ty == gguf.TokenType.CONTROL else (t_[2:] if t_.startswith("##") else "\u2581" + t_) for t_, ty in zip(vocab, types)]
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(phantom)
    w.add_token_types(types)
    w.add_bos_token_id(2)  # [CLS]
    w.add_sep_token_id(3)
    w.add_unk_token_id(1)
    w.add_pad_token_id(0)
    w.add_mask_token_id(4)
    names = {
        "embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.position_embeddings.weight": "position_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "embeddings.LayerNorm.weight": "token_embd_norm.weight",
        "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    }
    per_layer = {
        "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
    }
    for name, value in t.items():
        if name in names:
            w.add_tensor(names[name], value)
            continue
        _, _, l, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        w.add_tensor(f"blk.{l}.{per_layer[module]}.{kind}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n_params = sum(v.size for v in t.values())
    print(json.dumps({"hf": hf, "gguf": path, "parameters": n_params, "vocab": len(vocab)}))


if __name__ == "__main__":
    main()
