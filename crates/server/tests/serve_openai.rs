//! The official `openai` Python client against the real `vellum serve`
//! (default model, small KV cache): completions, chat, streaming, n > 1,
//! logprobs, stop strings and the error cases.

mod common;

use common::{python_with_openai, run_python, Server};

const KEY: &str = "test-key-123";
const MODEL: &str = "smol";
const MAX_MODEL_LEN: &str = "512";

#[test]
fn openai_python_client_drives_the_server() {
    let python = python_with_openai();
    let server =
        Server::start(&["--kv-cache-memory", "96MiB", "--max-model-len", MAX_MODEL_LEN, "--api-key", KEY, "--served-model-name", MODEL]);
    run_python(&python, "openai_client.py", &[server.base_url(), KEY.into(), MODEL.into(), MAX_MODEL_LEN.into()]);
}

/// `vellum serve --device wgpu` (lavapipe in CI) answers the OpenAI
/// endpoints, and its greedy text is the CPU backend's float32 path's (the
/// WGSL kernels compute in float32; the CPU default quantizes activations).
#[cfg(feature = "wgpu")]
#[test]
fn serve_on_wgpu_answers_the_openai_client() {
    let python = python_with_openai();
    let expected = {
        let cpu = Server::start(&["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--cpu-precision", "float32"]);
        let body = r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#;
        let (status, body) = cpu.request("POST", "/v1/completions", &[("Content-Type", "application/json")], body);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        v["choices"][0]["text"].as_str().expect("text").to_string()
    };
    let server = Server::start(&["--device", "wgpu", "--kv-cache-memory", "32MiB", "--max-model-len", "256"]);
    assert!(server.log_contains("wgpu adapter"), "the adapter is logged at start");
    run_python(&python, "openai_device.py", &[server.base_url(), expected]);
}

/// Gemma's chat format, as its instruction-tuned checkpoints write it.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n\
                              {{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

/// `vellum serve --model gemma3-270m`: the second real model (base model,
/// SentencePiece, K-quants) through the official client; chat is refused
/// without a template and stops at `<end_of_turn>` with one. Float32, since
/// the text must equal the float64 reference's: the reference's second greedy
/// token (" blue") leads " yellow" by only 0.096 nats, which the int8 default
/// may swap within the golden int8 rule (tests/golden.rs checks that rule).
#[test]
fn serve_gemma3_answers_completions_and_refuses_chat_without_a_template() {
    let python = python_with_openai();
    let common = ["--model", "gemma3-270m", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--cpu-precision", "float32"];
    let plain = Server::start(&common);
    let templated = Server::start(&[&common[..], &["--chat-template", GEMMA_TEMPLATE]].concat());
    run_python(&python, "openai_gemma.py", &[plain.base_url(), templated.base_url()]);
}

/// Structured outputs through the official client: 50 JSON schemas whose
/// outputs all validate (with the `jsonschema` package), regex, choice,
/// grammar and json_object, parallel samples, and 400s for bad constraints.
#[test]
fn structured_outputs_validate_through_the_openai_client() {
    let python = python_with_openai();
    let has_jsonschema = std::process::Command::new(&python).args(["-c", "import jsonschema"]).status().is_ok_and(|s| s.success());
    assert!(has_jsonschema, "the structured-output test needs the jsonschema package: python3 -m pip install jsonschema");
    let server = Server::start(&["--kv-cache-memory", "96MiB", "--max-model-len", "1024"]);
    run_python(&python, "openai_structured.py", &[server.base_url()]);
}

/// Tool calling through the official client (`python/openai_tools.py`):
/// `required` and named-function calls validate against their tools'
/// parameters whole, streamed and through the client's stream helper, and
/// all three agree; `auto`/`none` streams agree with whole responses; tool
/// results render back through the template; a cut-off call is `length`;
/// malformed tools and choices are 400s naming the field.
#[test]
fn tool_calls_validate_and_stream_through_the_openai_client() {
    let python = python_with_openai();
    let has_jsonschema = std::process::Command::new(&python).args(["-c", "import jsonschema"]).status().is_ok_and(|s| s.success());
    assert!(has_jsonschema, "the tool-calling test needs the jsonschema package: python3 -m pip install jsonschema");
    let server = Server::start(&["--kv-cache-memory", "96MiB", "--max-model-len", "1024"]);
    run_python(&python, "openai_tools.py", &[server.base_url()]);
}

/// Anthropic's Messages API through the official `anthropic` client
/// (`python/anthropic_messages.py`): text whole and streamed agree, tool use
/// whole and streamed with tool results rendered back, `count_tokens`,
/// `x-api-key`, and errors in Anthropic's shape naming the field.
#[test]
fn the_messages_api_answers_the_anthropic_client() {
    let python = python_with_openai();
    let has_anthropic = std::process::Command::new(&python).args(["-c", "import anthropic"]).status().is_ok_and(|s| s.success());
    assert!(has_anthropic, "the Messages API test needs the official client: python3 -m pip install anthropic (CI does this in .ci/run)");
    let server = Server::start(&[
        "--kv-cache-memory",
        "96MiB",
        "--max-model-len",
        "1024",
        "--api-key",
        "anthropic-key",
        "--served-model-name",
        "vellum",
    ]);
    run_python(&python, "anthropic_messages.py", &[server.base_url(), "anthropic-key".to_string()]);
}

/// OpenAI's Responses API through the official `openai` client
/// (`python/openai_responses.py`): whole, streamed through the client's
/// helper and raw, cut by `max_output_tokens`, tool calls and their outputs
/// through `previous_response_id`, a two-turn conversation, JSON schema, the
/// store (`retrieve`, `delete`, `store=False`) and 400/404s naming the field.
#[test]
fn the_responses_api_answers_the_openai_client() {
    let python = python_with_openai();
    let server = Server::start(&["--kv-cache-memory", "96MiB", "--max-model-len", "1024", "--api-key", KEY, "--served-model-name", MODEL]);
    run_python(&python, "openai_responses.py", &[server.base_url(), KEY.into(), MODEL.into()]);
}

#[cfg(not(feature = "wgpu"))]
#[test]
fn serve_on_wgpu_skipped_build_has_no_wgpu_feature() {
    eprintln!("skipped: build vellum-server with `--features wgpu` to test `serve --device wgpu`");
}

#[test]
fn queue_full_is_503_and_sigterm_exits_cleanly() {
    // With no room in the waiting queue every generation request is refused.
    let mut server = Server::start(&[
        "--kv-cache-memory",
        "32MiB",
        "--max-model-len",
        "256",
        "--max-waiting-requests",
        "0",
        "--max-request-body-bytes",
        "1024",
    ]);
    let json = [("Content-Type", "application/json")];
    let (status, body) = server.request("POST", "/v1/completions", &json, r#"{"prompt": "hi", "max_tokens": 2}"#);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"ServiceUnavailableError\""), "{body}");
    assert!(server.get("/metrics").1.contains("vellum:requests_rejected_busy_total{model_name=\"SmolLM2-135M-Instruct\",engine=\"0\"} 1"));
    // /health, /v1/models stay up; unknown routes are JSON 404s.
    assert_eq!(server.get("/health").0, 200);
    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert!(body.contains("\"SmolLM2-135M-Instruct\""), "{body}");
    let (status, body) = server.get("/nope");
    assert_eq!(status, 404);
    assert!(body.contains("NotFoundError"), "{body}");
    // Errors the HTTP framework answers itself come in vLLM's shape too.
    let (status, body) = server.get("/v1/completions");
    assert_eq!(status, 405, "{body}");
    assert!(body.contains(r#""type":"MethodNotAllowed""#) && body.contains(r#""code":405"#), "{body}");
    let big = format!(r#"{{"prompt": "{}", "max_tokens": 2}}"#, "x".repeat(2000));
    let (status, body) = server.request("POST", "/v1/completions", &json, &big);
    assert_eq!(status, 413, "{body}");
    assert!(body.contains(r#""type":"PayloadTooLargeError""#), "{body}");

    // SIGTERM: the server stops and exits 0.
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let status = server.wait_for_exit("SIGTERM");
    assert!(status.success(), "exit status {status:?}");
}

/// `vellum serve --speculative-config` (n-gram prompt lookup): greedy
/// completions, whole and streamed, are those of a server without it; the
/// stream's chunks carry several tokens when drafts are accepted; the
/// `vllm:spec_decode_*` counters count them; a bad config is refused at
/// start with the flag named.
#[test]
fn speculative_decoding_serves_the_text_of_plain_decoding() {
    let common = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"];
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#;
    let plain = Server::start(&common);
    let fast = Server::start(&[&common[..], &["--speculative-config", spec]].concat());
    let json = [("Content-Type", "application/json")];
    let text_of = |server: &Server, prompt: &str, stream: bool| {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": stream}).to_string();
        let (status, body) = server.request("POST", "/v1/completions", &json, &body);
        assert_eq!(status, 200, "{body}");
        if !stream {
            let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            return (v["choices"][0]["text"].as_str().expect("text").to_string(), 1);
        }
        let chunks: Vec<String> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok()?["choices"][0]["text"].as_str().map(str::to_string))
            .filter(|t| !t.is_empty())
            .collect();
        (chunks.concat(), chunks.len())
    };
    let prompts = [
        "Repeat after me three times: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "Once upon a time",
    ];
    let mut total_chunks = 0;
    for prompt in prompts {
        let (want, _) = text_of(&plain, prompt, false);
        assert_eq!(text_of(&fast, prompt, false).0, want, "{prompt:?}");
        let (streamed, chunks) = text_of(&fast, prompt, true);
        assert_eq!(streamed, want, "{prompt:?} streamed");
        total_chunks += chunks;
    }
    assert!(total_chunks < 3 * 48, "some chunks carry several tokens: {total_chunks} chunks for 144 tokens");
    let (_, metrics) = fast.get("/metrics");
    let accepted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("vllm:spec_decode_num_accepted_tokens_total{")?.split("} ").nth(1)?.parse::<f64>().ok())
        .expect("the accepted-tokens counter");
    assert!(accepted > 0.0, "drafts were accepted: {metrics}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vellum"))
        .args(["serve", "--speculative-config", r#"{"method": "eagle", "num_speculative_tokens": 2, "model": "x"}"#])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--speculative-config") && err.contains("eagle"), "{err}");
}

/// A ChatML template whose generation prompt opens `<think>`, as
/// DeepSeek-R1's does (it does not read `tools`: the default tool prompt of
/// the parser is used).
const THINKING_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                                 {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\
                                 {% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}";

/// `--reasoning-parser deepseek_r1 --tool-call-parser pythonic` through the
/// official clients (`python/openai_parsers.py`): text forced by
/// `guided_regex` splits into `reasoning_content` and a pythonic call (or
/// content), whole and streamed alike; the EOS is never text; unconstrained
/// output is all reasoning, a `reasoning` item in the Responses API and a
/// `thinking` block in the Messages API. The template closes `<think>` when
/// `enable_thinking` is false, as Qwen3's does: `chat_template_kwargs`,
/// Responses' `reasoning.effort: "none"` and Messages' `thinking: disabled`
/// reach it.
#[test]
fn reasoning_and_pythonic_tool_calls_split_through_the_clients() {
    let python = python_with_openai();
    let server = Server::start(&[
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        "--chat-template",
        THINKING_TEMPLATE,
        "--reasoning-parser",
        "deepseek_r1",
        "--tool-call-parser",
        "pythonic",
    ]);
    run_python(&python, "openai_parsers.py", &[server.base_url()]);
}
