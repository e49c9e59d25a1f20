//! The SentencePiece-style tokenizer GGUF files carry as
//! `tokenizer.ggml.model = llama` (Llama 1/2, Mistral v0.1, Gemma), encoding
//! exactly as llama.cpp does.
//!
//! The algorithm, from the metadata alone:
//! 1. **Partition.** Special tokens — control (type 3, only when special
//!    tokens are parsed), user-defined (4) and unknown (2) — are cut out of
//!    the text whole, longest first: every leftmost non-overlapping
//!    occurrence of the longest token, then of the next, and so on.
//! 2. **Merge.** Each remaining fragment (with `▁` prepended after a special
//!    token or at the start when `add_space_prefix`, and every space written
//!    as `▁`) starts as one symbol per character. The adjacent pair whose
//!    concatenation is a vocabulary entry with the highest score merges
//!    first (leftmost on ties), until no pair is in the vocabulary.
//! 3. **Byte fallback.** A symbol not in the vocabulary (an unknown
//!    character: merged symbols always are) becomes its UTF-8 bytes as
//!    `<0xNN>` tokens (type 6).
//!
//! Why not the `tokenizers` crate: its BPE ranks merges by *pair*, while
//! SentencePiece ranks by the *merged piece's* score; expressing one in the
//! other means a merge list with every split of every piece (millions for
//! Gemma's 262,144 entries) and still differs on ties. This file is the
//! algorithm itself, a hundred lines, checked against llama.cpp's ids.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub(crate) fn from_gguf(ty: i64) -> Self {
        match ty {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    /// Matched whole before merging (control and unknown only when special
    /// tokens are parsed).
    fn is_special(self, parse_special: bool) -> bool {
        match self {
            Self::UserDefined => true,
            Self::Control | Self::Unknown => parse_special,
            _ => false,
        }
    }
}

/// The word-boundary marker SentencePiece writes for a space.
const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary with scores.
pub(crate) struct SpmTokenizer {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<TokenType>,
    /// Piece → id; a later duplicate wins, as in llama.cpp.
    ids: HashMap<String, u32>,
    /// `<0xNN>` token of each byte, when the vocabulary has it.
    byte_ids: [Option<u32>; 256],
    unknown_id: Option<u32>,
    /// Special pieces → (rank, id): rank orders longest first, then by id.
    special: HashMap<String, (u32, u32)>,
    /// The id of each rank.
    special_by_rank: Vec<u32>,
    /// The distinct byte lengths of the special pieces.
    special_lengths: Vec<usize>,
    /// Whether some special piece starts with this byte (most text
    /// positions are skipped without a lookup).
    special_first_bytes: [bool; 256],
    add_space_prefix: bool,
}

/// A piece of the partitioned text.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl SpmTokenizer {
    /// `pieces`, `scores` and `types` are parallel (the caller checks their
    /// lengths).
    pub(crate) fn new(pieces: Vec<String>, scores: Vec<f32>, types: Vec<TokenType>, add_space_prefix: bool) -> Self {
        let mut ids = HashMap::with_capacity(pieces.len());
        let mut byte_ids = [None; 256];
        let mut unknown_id = None;
        let mut special_ids = Vec::new();
        for (id, (piece, &ty)) in pieces.iter().zip(&types).enumerate() {
            let id = id as u32;
            ids.insert(piece.clone(), id);
            if ty == TokenType::Unknown && unknown_id.is_none() {
                unknown_id = Some(id);
            }
            if ty.is_special(true) && !piece.is_empty() {
                special_ids.push(id);
            }
        }
        // Byte fallback looks `<0xNN>` up by name, as llama.cpp does.
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        // Stable: equal lengths keep id order.
        special_ids.sort_by_key(|&id| std::cmp::Reverse(pieces[id as usize].len()));
        let mut special = HashMap::with_capacity(special_ids.len());
        for (rank, &id) in special_ids.iter().enumerate() {
            special.entry(pieces[id as usize].clone()).or_insert((rank as u32, id));
        }
        let special_by_rank = special_ids;
        let mut special_first_bytes = [false; 256];
        for piece in special.keys() {
            special_first_bytes[piece.as_bytes()[0] as usize] = true;
        }
        let mut special_lengths: Vec<usize> = special.keys().map(String::len).collect();
        special_lengths.sort_unstable();
        special_lengths.dedup();
        Self {
            pieces,
            scores,
            types,
            ids,
            byte_ids,
            unknown_id,
            special,
            special_by_rank,
            special_lengths,
            special_first_bytes,
            add_space_prefix,
        }
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub(crate) fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Token ids of `text` (no BOS/EOS: the caller adds those).
    pub(crate) fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut after_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && after_special {
                        s.push(SPACE);
                    }
                    s.extend(t.chars().map(|c| if c == ' ' { SPACE } else { c }));
                    self.merge(&s, &mut out);
                    after_special = false;
                }
            }
        }
        out
    }

    /// Step 1: special tokens cut out whole, longest first.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let bytes = text.as_bytes();
        let mut claimed: Vec<(usize, usize, u32)> = Vec::new();
        let mut taken = vec![false; text.len()];
        // Ranks order pieces longest first, so lengths are taken in
        // decreasing order and, within one length, pieces by rank. Only the
        // current length's occurrences at unclaimed positions are held
        // (sixteen bytes each), so memory stays linear in the text however
        // many special pieces its runs of newlines or spaces match.
        let mut found: Vec<(u32, usize)> = Vec::new();
        for &len in self.special_lengths.iter().rev() {
            found.clear();
            for (start, _) in text.char_indices() {
                if taken[start] || !self.special_first_bytes[bytes[start] as usize] {
                    continue;
                }
                let Some(piece) = text.get(start..start + len) else { continue };
                if let Some(&(rank, id)) = self.special.get(piece) {
                    if self.types[id as usize].is_special(parse_special) {
                        found.push((rank, start));
                    }
                }
            }
            found.sort_unstable();
            // Claim piece by piece in rank order: left to right without
            // overlapping itself, never across a range already claimed.
            let mut i = 0;
            while i < found.len() {
                let rank = found[i].0;
                let id = self.special_by_rank[rank as usize];
                let mut searched_to = 0;
                while i < found.len() && found[i].0 == rank {
                    let start = found[i].1;
                    let end = start + len;
                    if start >= searched_to && !taken[start..end].contains(&true) {
                        taken[start..end].fill(true);
                        claimed.push((start, end, id));
                        searched_to = end;
                    }
                    i += 1;
                }
            }
        }
        claimed.sort_unstable();
        let mut fragments = Vec::with_capacity(2 * claimed.len() + 1);
        let mut at = 0;
        for (start, end, id) in claimed {
            if start > at {
                fragments.push(Fragment::Text(&text[at..start]));
            }
            fragments.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            fragments.push(Fragment::Text(&text[at..]));
        }
        fragments
    }

    /// Steps 2 and 3 on one fragment.
    fn merge(&self, text: &str, out: &mut Vec<u32>) {
        // One symbol per character: byte range [start, end), linked list.
        let mut start: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let n = start.len();
        if n == 0 {
            return;
        }
        let mut end: Vec<usize> = start[1..].iter().copied().chain([text.len()]).collect();
        let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let mut next: Vec<Option<usize>> = (0..n).map(|i| (i + 1 < n).then_some(i + 1)).collect();
        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<Bigram>, start: &[usize], end: &[usize], left: usize, right: usize| {
            if let Some(id) = self.id(&text[start[left]..end[right]]) {
                queue.push(Bigram { score: self.scores[id as usize], left, right, len: end[right] - start[left] });
            }
        };
        for i in 1..n {
            push(&mut queue, &start, &end, i - 1, i);
        }
        while let Some(Bigram { left, right, len, .. }) = queue.pop() {
            // Stale when either side already merged elsewhere.
            let live = start[left] < end[left] && start[right] < end[right] && end[right] - start[left] == len;
            if !live || next[left] != Some(right) {
                continue;
            }
            end[left] = end[right];
            start[right] = end[right]; // empty: merged away
            next[left] = next[right];
            if let Some(after) = next[right] {
                prev[after] = Some(left);
            }
            if let Some(before) = prev[left] {
                push(&mut queue, &start, &end, before, left);
            }
            if let Some(after) = next[left] {
                push(&mut queue, &start, &end, left, after);
            }
        }
        let mut symbol = Some(0);
        while let Some(i) = symbol {
            let piece = &text[start[i]..end[i]];
            match self.id(piece) {
                Some(id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        out.extend(self.byte_ids[b as usize].or(self.unknown_id));
                    }
                }
            }
            symbol = next[i];
        }
    }

    /// The text of `ids`: byte tokens become bytes, `▁` a space; control and
    /// unknown tokens are written only without `skip_special`. Ids outside
    /// the vocabulary are skipped.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let (Some(piece), Some(&ty)) = (self.pieces.get(id as usize), self.types.get(id as usize)) else { continue };
            match ty {
                TokenType::Byte => match parse_byte_piece(piece) {
                    Some(b) => bytes.push(b),
                    None => bytes.extend_from_slice(piece.as_bytes()),
                },
                TokenType::Control | TokenType::Unknown => {
                    if !skip_special {
                        bytes.extend_from_slice(piece.as_bytes());
                    }
                }
                TokenType::UserDefined => bytes.extend_from_slice(piece.as_bytes()),
                TokenType::Normal | TokenType::Unused => {
                    let mut buf = [0u8; 4];
                    for c in piece.chars() {
                        let c = if c == SPACE { ' ' } else { c };
                        bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every token's bytes as generated text (byte tokens their byte, `▁`
    /// a space); control and unknown tokens are `0xFF` then their piece, so
    /// that constrained decoding never takes them for text.
    pub(crate) fn token_bytes(&self) -> Vec<Vec<u8>> {
        self.pieces
            .iter()
            .zip(&self.types)
            .map(|(piece, &ty)| match ty {
                TokenType::Byte => parse_byte_piece(piece).map_or_else(|| piece.as_bytes().to_vec(), |b| vec![b]),
                TokenType::Control | TokenType::Unknown => {
                    let mut v = vec![0xFF];
                    v.extend_from_slice(piece.as_bytes());
                    v
                }
                TokenType::UserDefined => piece.as_bytes().to_vec(),
                TokenType::Normal | TokenType::Unused => piece.replace(SPACE, " ").into_bytes(),
            })
            .collect()
    }

    /// Whether `id` is a control or unknown token (dropped by
    /// `skip_special_tokens`).
    pub(crate) fn is_control(&self, id: u32) -> bool {
        matches!(self.types.get(id as usize), Some(TokenType::Control | TokenType::Unknown))
    }
}

/// `<0xNN>` → the byte.
fn parse_byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged piece, to spot stale entries.
    len: usize,
}

impl Ord for Bigram {
    /// Highest score first; on equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: `▁ab` outscores `ab` outscores `▁a`.
    fn toy(add_space_prefix: bool) -> SpmTokenizer {
        let mut pieces: Vec<String> =
            ["<unk>", "<s>", "<ctl>", "<b>", "▁", "a", "b", "ab", "▁a", "▁ab", "  "].iter().map(|s| s.to_string()).collect();
        let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control, TokenType::UserDefined];
        types.extend([TokenType::Normal; 6]);
        types.push(TokenType::UserDefined);
        let mut scores = vec![0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.7, -0.1, 0.0];
        for b in 0..=255u8 {
            pieces.push(format!("<0x{b:02X}>"));
            types.push(TokenType::Byte);
            scores.push(0.0);
        }
        SpmTokenizer::new(pieces, scores, types, add_space_prefix)
    }

    #[test]
    fn merges_follow_the_merged_pieces_scores() {
        let t = toy(false);
        // "ab" (-0.5) merges before "▁a" (-0.7), then "▁"+"ab" = "▁ab".
        assert_eq!(t.encode(" ab", true), [9]);
        assert_eq!(t.encode("ab b", true), [7, 4, 6]);
        // With the space prefix, a leading `▁` is added.
        assert_eq!(toy(true).encode("ab", true), [9]);
    }

    #[test]
    fn special_tokens_are_cut_out_whole_and_unknown_chars_fall_back_to_bytes() {
        let t = toy(false);
        assert_eq!(t.encode("a<ctl>b", true), [5, 2, 6]);
        // Without parse_special the control token is plain text (bytes here).
        let plain = t.encode("<ctl>", false);
        assert_eq!(t.decode(&plain, false), "<ctl>");
        assert!(plain.iter().all(|&id| id >= 11));
        // User-defined tokens are always matched; longest first.
        assert_eq!(t.encode("a  <b>", false), [5, 10, 3]);
        // é is two bytes: 0xC3 0xA9.
        assert_eq!(t.encode("é", true), [11 + 0xC3, 11 + 0xA9]);
        assert_eq!(t.decode(&[11 + 0xC3, 11 + 0xA9, 9, 2], true), "é ab");
        assert_eq!(t.decode(&[2], false), "<ctl>");
    }
}
