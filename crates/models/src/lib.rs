//! # vellum-models — model definitions and loaders
//!
//! Will hold one model definition per architecture (`LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`), written
//! once against the backend-neutral contracts of `vellum-core`, plus the
//! loaders for Hugging Face directories (safetensors) and GGUF files, the
//! tokenizer and the chat template (the Renderer of thesis §4.3.2).
//!
//! Status: empty. It is filled by the "Real models on the CPU backend" issue.
