//! Stop strings matched on streamed text, across and inside deltas.
//!
//! The text that could still become a stop string is held back, so nothing is emitted and then
//! taken back. The first stop string to be completed wins (on a tie, the one starting earlier),
//! so the result does not depend on how the text was cut into deltas.

use super::error::{Result, TextError};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is safe to show now.
    pub emit: String,
    /// The stop string that ended the request, if one did.
    pub stopped: Option<String>,
}

#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    held: String,
    stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool) -> Result<Self> {
        if stops.iter().any(String::is_empty) {
            return Err(TextError::InvalidArgument(
                "stop strings must not be empty".into(),
            ));
        }
        Ok(StopStrings {
            stops,
            include_stop_str_in_output,
            held: String::new(),
            stopped: false,
        })
    }

    /// Takes the next piece of output text. After a stop string is found, everything is dropped.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.stopped {
            return StopStep::default();
        }
        self.held.push_str(delta);
        if let Some((start, stop)) = self.first_completed_stop() {
            let stop = stop.to_string();
            let end = start + stop.len();
            let mut emit = std::mem::take(&mut self.held);
            emit.truncate(if self.include_stop_str_in_output {
                end
            } else {
                start
            });
            self.stopped = true;
            return StopStep {
                emit,
                stopped: Some(stop),
            };
        }
        let keep = self.held.len() - self.longest_partial_stop_suffix();
        let rest = self.held.split_off(keep);
        StopStep {
            emit: std::mem::replace(&mut self.held, rest),
            stopped: None,
        }
    }

    /// Takes text that may not end the request (before `min_tokens`): it is emitted
    /// whole, with whatever was held back, and never matched.
    pub fn pass_through(&mut self, delta: &str) -> String {
        if self.stopped {
            return String::new();
        }
        let mut emit = std::mem::take(&mut self.held);
        emit.push_str(delta);
        emit
    }

    /// Releases the held-back text when the request ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Byte offset and text of the stop string that ends first in `held`.
    fn first_completed_stop(&self) -> Option<(usize, &str)> {
        self.stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()).map(|at| (at, stop.as_str())))
            .min_by_key(|(at, stop)| (at + stop.len(), *at))
    }

    /// Bytes at the end of `held` that are a proper prefix of some stop string.
    fn longest_partial_stop_suffix(&self) -> usize {
        self.stops
            .iter()
            .map(|stop| {
                stop.char_indices()
                    .skip(1)
                    .map(|(len, _)| len)
                    .filter(|&len| self.held.ends_with(&stop[..len]))
                    .max()
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str], include: bool) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect(), include).unwrap()
    }

    /// Feeds `deltas`; returns everything emitted (plus `finish` if no stop) and the stop.
    fn run(matcher: &mut StopStrings, deltas: &[&str]) -> (String, Option<String>) {
        let mut out = String::new();
        for delta in deltas {
            let step = matcher.push(delta);
            out += &step.emit;
            if step.stopped.is_some() {
                return (out, step.stopped);
            }
        }
        out += &matcher.finish();
        (out, None)
    }

    /// Cuts `text` at char boundaries chosen by `seed`.
    fn split(text: &str, seed: u64) -> Vec<&str> {
        let mut state = seed | 1;
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut at = (state % 5) as usize;
            while at < rest.len() && !rest.is_char_boundary(at) {
                at += 1;
            }
            let at = at.min(rest.len());
            pieces.push(&rest[..at]);
            rest = &rest[at..];
        }
        pieces
    }

    #[test]
    fn stops_across_deltas_and_inside_one() {
        let mut m = stops(&["STOP"], false);
        assert_eq!(
            run(&mut m, &["hello ST", "O", "P and more"]),
            ("hello ".into(), Some("STOP".into()))
        );
        let mut m = stops(&["STOP"], true);
        assert_eq!(
            run(&mut m, &["aSTOPb"]),
            ("aSTOP".into(), Some("STOP".into()))
        );
        assert_eq!(m.push("more"), StopStep::default());
        assert!(m.is_stopped());
    }

    #[test]
    fn holds_back_only_a_possible_start_of_a_stop() {
        let mut m = stops(&["</answer>", "##"], false);
        assert_eq!(m.push("x </ans").emit, "x ");
        assert_eq!(m.push("wer").emit, "");
        assert_eq!(m.push("!").emit, "</answer!");
        assert_eq!(m.push("a#").emit, "a");
        assert_eq!(m.finish(), "#");
    }

    #[test]
    fn hold_back_counts_characters_not_bytes() {
        let mut m = stops(&["終わり。"], false);
        let step = m.push("はい終わ");
        assert_eq!(step.emit, "はい");
        assert_eq!(m.held.chars().count(), 2);
        assert_eq!(m.push("らない").emit, "終わらない");
        let mut m = stops(&["😀😀!"], true);
        assert_eq!(m.push("a😀😀").emit, "a");
        assert_eq!(m.push("!").emit, "😀😀!");
    }

    #[test]
    fn the_first_stop_to_complete_wins() {
        let mut m = stops(&["abcd", "c", "bc"], false);
        // "c" and "bc" complete together; "bc" starts earlier.
        assert_eq!(
            run(&mut m, &["xab", "cd"]),
            ("xa".into(), Some("bc".into()))
        );
        let mut m = stops(&["world", "o"], true);
        assert_eq!(
            run(&mut m, &["hello world"]),
            ("hello".into(), Some("o".into()))
        );
    }

    #[test]
    fn result_does_not_depend_on_how_text_is_cut() {
        let text = "Résumé: 你好👨‍👩‍👧 <|end|> tail ends here";
        let cases: [(&[&str], bool); 4] = [
            (&["<|end|>"], false),
            (&["<|end|>", "👩"], true),
            (&["ends here", "nope"], false),
            (&["absent", "也"], true),
        ];
        for (list, include) in cases {
            let expected = run(&mut stops(list, include), &[text]);
            for seed in 1..200 {
                let pieces = split(text, seed);
                let mut m = stops(list, include);
                let mut out = String::new();
                let mut stopped = None;
                for piece in &pieces {
                    let step = m.push(piece);
                    out += &step.emit;
                    // Never more than longest-stop-minus-one characters held back.
                    let longest = list.iter().map(|s| s.chars().count()).max().unwrap();
                    assert!(m.held.chars().count() < longest);
                    if step.stopped.is_some() {
                        stopped = step.stopped;
                        break;
                    }
                }
                if stopped.is_none() {
                    out += &m.finish();
                }
                assert_eq!((out, stopped), expected, "{list:?} {pieces:?}");
            }
        }
    }

    #[test]
    fn empty_stop_strings_are_rejected() {
        let err = StopStrings::new(vec!["ok".into(), String::new()], false).unwrap_err();
        assert!(matches!(err, TextError::InvalidArgument(_)));
        let mut none = StopStrings::new(Vec::new(), false).unwrap();
        assert_eq!(none.push("anything").emit, "anything");
    }
}
