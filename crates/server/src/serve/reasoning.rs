//! The model's reasoning split from its answer (`--reasoning-parser`, named
//! as vLLM names them): the text between `<think>` and `</think>` is
//! reasoning, what follows is content (which then goes to the tool-call
//! parser, so "`<think>…</think><tool_call>…`" is reasoning and a call).
//!
//! | parser | starts in reasoning | a leading `<think>` |
//! |---|---|---|
//! | `deepseek_r1` | always (R1's templates open `<think>` in the prompt) | dropped |
//! | `qwen3` | when the rendered prompt ends inside `<think>` | opens reasoning |
//!
//! Reasoning ends at `</think>` (whitespace after it is dropped); without
//! one, everything after the start is reasoning (the budget ran out while
//! thinking). [`ReasoningParser`] works one delta at a time and holds back
//! text that may still be part of a tag, so any split of the text gives
//! the events of the whole.

use super::tool_format::partial_suffix;

/// `--reasoning-parser` values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParserKind {
    /// DeepSeek-R1 (and its distills): the output starts inside reasoning.
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    /// Qwen3: reasoning when the output opens `<think>` or the prompt did.
    Qwen3,
}

/// Opens reasoning.
const THINK_OPEN: &str = "<think>";
/// Ends reasoning.
const THINK_CLOSE: &str = "</think>";

/// A piece of split text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReasoningEvent {
    /// Reasoning (the tags left out).
    Reasoning(String),
    /// The answer.
    Content(String),
}

/// Where the splitter stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Inside reasoning before any text: a `<think>` (after whitespace) is
    /// dropped.
    ReasoningStart,
    /// Before any text, outside reasoning: a `<think>` (after whitespace)
    /// opens reasoning; anything else is content.
    Opening,
    /// Inside reasoning.
    Reasoning,
    /// Right after `</think>`: whitespace is dropped.
    AfterClose,
    /// The answer.
    Content,
}

/// Splits one choice's text into reasoning and content, delta by delta.
#[derive(Clone, Debug)]
pub struct ReasoningParser {
    phase: Phase,
    /// Text not yet decided (a possible tag, leading whitespace).
    buf: String,
    /// Output tokens spent reasoning so far ([`ReasoningParser::push_tokens`]).
    reasoning_tokens: usize,
    /// Whether the text has entered the reasoning.
    entered_reasoning: bool,
}

impl ReasoningParserKind {
    /// A splitter for the output that follows `prompt` (the rendered chat
    /// prompt).
    pub fn parser(self, prompt: &str) -> ReasoningParser {
        let inside = match self {
            ReasoningParserKind::DeepseekR1 => true,
            ReasoningParserKind::Qwen3 => prompt_opens_reasoning(prompt),
        };
        ReasoningParser {
            phase: if inside { Phase::ReasoningStart } else { Phase::Opening },
            buf: String::new(),
            reasoning_tokens: 0,
            entered_reasoning: false,
        }
    }
}

/// Whether the prompt ends inside `<think>` (its last tag is an opening
/// one, followed by nothing but whitespace).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

impl ReasoningParser {
    /// Feeds the next piece of text.
    pub fn push(&mut self, delta: &str) -> Vec<ReasoningEvent> {
        self.buf.push_str(delta);
        let mut events = Vec::new();
        self.scan(&mut events, false);
        events
    }

    /// [`push`](Self::push) of the text of `tokens` output tokens, counted
    /// as reasoning tokens (the usage's `reasoning_tokens`) when they fall
    /// inside the reasoning: from its start (or the delta that opens it)
    /// through the delta that closes it.
    pub fn push_tokens(&mut self, delta: &str, tokens: usize) -> Vec<ReasoningEvent> {
        let (before, entered) = (self.phase, self.entered_reasoning);
        let events = self.push(delta);
        // This delta opened the reasoning (`<think>` after nothing but whitespace).
        let opened = !entered && self.entered_reasoning;
        if matches!(before, Phase::ReasoningStart | Phase::Reasoning) || opened {
            self.reasoning_tokens += tokens;
        }
        events
    }

    /// Output tokens counted as reasoning so far.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Ends the text: what was held back.
    pub fn finish(&mut self) -> Vec<ReasoningEvent> {
        let mut events = Vec::new();
        self.scan(&mut events, true);
        events
    }

    fn scan(&mut self, events: &mut Vec<ReasoningEvent>, at_end: bool) {
        loop {
            match self.phase {
                Phase::ReasoningStart | Phase::Opening => {
                    let rest = self.buf.trim_start();
                    if rest.starts_with(THINK_OPEN) {
                        let drop = self.buf.len() - rest.len() + THINK_OPEN.len();
                        self.buf.drain(..drop);
                        self.phase = Phase::Reasoning;
                        self.entered_reasoning = true;
                    } else if !at_end && THINK_OPEN.starts_with(rest) {
                        // Whitespace, or the start of `<think>`: wait.
                        return;
                    } else {
                        self.phase = if self.phase == Phase::Opening { Phase::Content } else { Phase::Reasoning };
                        self.entered_reasoning |= self.phase == Phase::Reasoning;
                    }
                }
                Phase::Reasoning => {
                    if let Some(i) = self.buf.find(THINK_CLOSE) {
                        let reasoning: String = self.buf.drain(..i).collect();
                        self.buf.drain(..THINK_CLOSE.len());
                        emit(events, ReasoningEvent::Reasoning(reasoning));
                        self.phase = Phase::AfterClose;
                        continue;
                    }
                    let keep = if at_end { 0 } else { partial_suffix(&self.buf, THINK_CLOSE) };
                    let reasoning: String = self.buf.drain(..self.buf.len() - keep).collect();
                    emit(events, ReasoningEvent::Reasoning(reasoning));
                    return;
                }
                Phase::AfterClose => {
                    let ws = self.buf.len() - self.buf.trim_start().len();
                    self.buf.drain(..ws);
                    if self.buf.is_empty() {
                        return;
                    }
                    self.phase = Phase::Content;
                }
                Phase::Content => {
                    let content = std::mem::take(&mut self.buf);
                    emit(events, ReasoningEvent::Content(content));
                    return;
                }
            }
        }
    }
}

/// Appends an event, merged into the last one of its kind and never empty.
fn emit(events: &mut Vec<ReasoningEvent>, e: ReasoningEvent) {
    match (events.last_mut(), e) {
        (_, ReasoningEvent::Reasoning(t) | ReasoningEvent::Content(t)) if t.is_empty() => {}
        (Some(ReasoningEvent::Reasoning(prev)), ReasoningEvent::Reasoning(t)) => prev.push_str(&t),
        (Some(ReasoningEvent::Content(prev)), ReasoningEvent::Content(t)) => prev.push_str(&t),
        (_, e) => events.push(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(reasoning, content)` of events, each `None` when empty.
    fn join(events: &[ReasoningEvent]) -> (Option<String>, Option<String>) {
        let (mut r, mut c) = (String::new(), String::new());
        for e in events {
            match e {
                ReasoningEvent::Reasoning(t) => r.push_str(t),
                ReasoningEvent::Content(t) => c.push_str(t),
            }
        }
        ((!r.is_empty()).then_some(r), (!c.is_empty()).then_some(c))
    }

    fn whole(p: &ReasoningParser, text: &str) -> Vec<ReasoningEvent> {
        let mut p = p.clone();
        let mut events = p.push(text);
        for e in p.finish() {
            emit(&mut events, e);
        }
        events
    }

    /// Every cut of `text` into three deltas gives the events of the whole
    /// (concatenated by kind, in the same order of kinds).
    fn split_agrees(fresh: &ReasoningParser, text: &str) -> (Option<String>, Option<String>) {
        let all = whole(fresh, text);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j >= i) {
                let mut p = fresh.clone();
                let mut events = Vec::new();
                for part in [&text[..i], &text[i..j], &text[j..]] {
                    for e in p.push(part) {
                        emit(&mut events, e);
                    }
                }
                for e in p.finish() {
                    emit(&mut events, e);
                }
                assert_eq!(events, all, "cut at {i} and {j} of {text:?}");
            }
        }
        join(&all)
    }

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn deepseek_r1_output_starts_inside_reasoning() {
        let r1 = ReasoningParserKind::DeepseekR1.parser("<｜User｜>2+2?<｜Assistant｜><think>\n");
        let text = "Okay, the user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.";
        assert_eq!(split_agrees(&r1, text), (some("Okay, the user asks 2+2. That is 4.\n"), some("The answer is **4**.")));
        // A model that writes `<think>` itself: dropped.
        assert_eq!(split_agrees(&r1, "\n<think>\nHmm.</think>Yes."), (some("\nHmm."), some("Yes.")));
        // Cut off while thinking: all reasoning, even a partial tag.
        assert_eq!(split_agrees(&r1, "Let me think </thi"), (some("Let me think </thi"), None));
        assert_eq!(split_agrees(&r1, "<thi"), (some("<thi"), None));
        assert_eq!(split_agrees(&r1, ""), (None, None));
        assert_eq!(split_agrees(&r1, "</think>"), (None, None));
    }

    #[test]
    fn qwen3_reasons_when_the_output_or_the_prompt_opens_think() {
        let fresh = ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n");
        let text = "<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (reasoning, content) = split_agrees(&fresh, text);
        assert_eq!(reasoning, some("\nThe user wants the weather; call the tool.\n"));
        assert_eq!(content.as_deref(), Some(&text[text.find("<tool_call>").unwrap_or(0)..]));
        // No `<think>`: all content, untouched (a `</think>` inside too).
        assert_eq!(split_agrees(&fresh, " Hi </think> there"), (None, some(" Hi </think> there")));
        assert_eq!(split_agrees(&fresh, "<thin"), (None, some("<thin")));
        // Thinking disabled by the template: the prompt closes it.
        let closed = ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n<think>\n\n</think>\n\n");
        assert_eq!(split_agrees(&closed, "Hello!"), (None, some("Hello!")));
        // The prompt opens it: the output starts inside.
        let open = ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n<think>\n");
        assert_eq!(split_agrees(&open, "Short.</think>Done."), (some("Short."), some("Done.")));
    }

    #[test]
    fn reasoning_tokens_are_those_from_the_opening_through_the_closing_delta() {
        // DeepSeek-R1 starts inside: "Hmm" "." "</think>" "\n\n" "Hi" — three reasoning tokens.
        let mut p = ReasoningParserKind::DeepseekR1.parser("");
        for (d, n) in [("Hmm", 1), (".", 1), ("</think>", 1), ("\n\n", 1), ("Hi", 1)] {
            p.push_tokens(d, n);
        }
        assert_eq!(p.reasoning_tokens(), 3);
        // Qwen3 opening `<think>` itself; a delta of two tokens counts two.
        let mut p = ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n");
        for (d, n) in [("<think>", 1), ("a b", 2), ("</think>Hi", 2), (" there", 1)] {
            p.push_tokens(d, n);
        }
        assert_eq!(p.reasoning_tokens(), 5);
        // No reasoning at all: none counted.
        let mut p = ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n");
        for (d, n) in [("Hello", 1), (" <think>", 1)] {
            p.push_tokens(d, n);
        }
        assert_eq!(p.reasoning_tokens(), 0);
    }

    #[test]
    fn multibyte_text_and_tags_in_content_are_kept() {
        let r1 = ReasoningParserKind::DeepseekR1.parser("");
        let text = "思考中…</think>答え: <think>は</think>でない";
        assert_eq!(split_agrees(&r1, text), (some("思考中…"), some("答え: <think>は</think>でない")));
    }
}
