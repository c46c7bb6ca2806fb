//! A deterministic English-like corpus for the byte-level GPT: sentences drawn from a
//! small grammar over a few hundred words, so that a tiny model can learn spelling,
//! spacing, punctuation and word order within a few hundred steps.

use brigade_tensor::Rng;

const NOUNS: &str = "cat dog bird fish horse cow sheep goat fox wolf bear mouse rabbit deer owl \
    farmer baker teacher doctor sailor painter writer singer child girl boy woman man king queen \
    friend neighbour stranger captain soldier student river mountain forest garden village city \
    house door window table chair bed lamp book letter song story map key coin ring box basket \
    bread apple cake cheese soup tea milk water stone tree flower leaf field road bridge boat ship \
    train car wheel hill lake sea island tower castle market shop school church kitchen room wall \
    fire candle storm rain wind cloud star moon sun morning evening night winter summer";
const ADJECTIVES: &str = "old young small big tall short quiet loud happy sad brave shy clever \
    kind gentle angry tired hungry busy lazy proud poor rich strange famous little warm cold \
    bright dark wet dry green red blue yellow white black golden silver heavy light soft hard \
    quick slow sweet bitter fresh empty full clean dirty round narrow wide deep long lonely \
    ancient curious careful patient polite";
/// `base:past` pairs.
const VERBS: &str = "see:saw find:found take:took give:gave make:made bring:brought hold:held \
    carry:carried open:opened close:closed paint:painted build:built buy:bought sell:sold \
    watch:watched follow:followed help:helped call:called visit:visited like:liked love:loved \
    want:wanted need:needed keep:kept leave:left lose:lost meet:met read:read write:wrote \
    draw:drew clean:cleaned fix:fixed break:broke hide:hid wash:washed cook:cooked eat:ate \
    throw:threw catch:caught push:pushed pull:pulled lift:lifted drop:dropped share:shared \
    remember:remembered forget:forgot notice:noticed answer:answered thank:thanked \
    teach:taught show:showed move:moved count:counted";
const ADVERBS: &str = "slowly quickly quietly happily sadly carefully suddenly gently loudly \
    often never always soon finally again early late proudly bravely calmly nearly almost";
const NAMES: &str = "Anna Ben Clara David Emma Felix Grace Henry Iris Jack Kate Leo Maya Noah \
    Olive Peter Rosa Sam Tom Una Victor Wendy Max Lily Oscar Ruby Hugo Nora Theo Eva";
const PREPOSITIONS: &str = "in on under near behind beside across through into from with over";
const DETERMINERS: &str = "the the the a a this that every my her his our their one";
const CONNECTIVES: &str = "and but so because while";

struct Words<'a> {
    nouns: Vec<&'a str>,
    adjectives: Vec<&'a str>,
    verbs: Vec<(&'a str, &'a str)>,
    adverbs: Vec<&'a str>,
    names: Vec<&'a str>,
    prepositions: Vec<&'a str>,
    determiners: Vec<&'a str>,
    connectives: Vec<&'a str>,
}

fn pick<'a>(rng: &mut Rng, v: &[&'a str]) -> &'a str {
    v[rng.below(v.len() as u64) as usize]
}

impl Words<'static> {
    fn new() -> Self {
        let list = |s: &'static str| s.split_whitespace().collect::<Vec<_>>();
        Words {
            nouns: list(NOUNS),
            adjectives: list(ADJECTIVES),
            verbs: VERBS.split_whitespace().filter_map(|p| p.split_once(':')).collect(),
            adverbs: list(ADVERBS),
            names: list(NAMES),
            prepositions: list(PREPOSITIONS),
            determiners: list(DETERMINERS),
            connectives: list(CONNECTIVES),
        }
    }

    /// "the old fox", "a river", or a name.
    fn noun_phrase(&self, rng: &mut Rng, out: &mut String) {
        if rng.below(5) == 0 {
            out.push_str(pick(rng, &self.names));
            return;
        }
        out.push_str(pick(rng, &self.determiners));
        out.push(' ');
        if rng.below(2) == 0 {
            out.push_str(pick(rng, &self.adjectives));
            out.push(' ');
        }
        out.push_str(pick(rng, &self.nouns));
    }

    /// "the baker quietly took a cake near the bridge"
    fn clause(&self, rng: &mut Rng, out: &mut String) {
        self.noun_phrase(rng, out);
        out.push(' ');
        if rng.below(4) == 0 {
            out.push_str(pick(rng, &self.adverbs));
            out.push(' ');
        }
        out.push_str(self.verbs[rng.below(self.verbs.len() as u64) as usize].1);
        out.push(' ');
        self.noun_phrase(rng, out);
        if rng.below(3) == 0 {
            out.push(' ');
            out.push_str(pick(rng, &self.prepositions));
            out.push(' ');
            self.noun_phrase(rng, out);
        }
    }

    fn sentence(&self, rng: &mut Rng, out: &mut String) {
        let start = out.len();
        match rng.below(6) {
            0 => {
                out.push_str("did ");
                self.noun_phrase(rng, out);
                out.push(' ');
                out.push_str(self.verbs[rng.below(self.verbs.len() as u64) as usize].0);
                out.push(' ');
                self.noun_phrase(rng, out);
                out.push('?');
            }
            1 => {
                self.noun_phrase(rng, out);
                out.push_str(" was ");
                out.push_str(pick(rng, &self.adjectives));
                out.push_str(" and ");
                out.push_str(pick(rng, &self.adjectives));
                out.push('.');
            }
            2 => {
                out.push_str(pick(rng, &self.names));
                out.push_str(" said, \"");
                let q = out.len();
                self.clause(rng, out);
                capitalise(out, q);
                out.push_str(".\"");
            }
            3 => {
                self.clause(rng, out);
                out.push_str(", ");
                out.push_str(pick(rng, &self.connectives));
                out.push(' ');
                self.clause(rng, out);
                out.push('.');
            }
            _ => {
                self.clause(rng, out);
                out.push('.');
            }
        }
        capitalise(out, start);
    }
}

/// Upper-cases the ASCII letter at byte `at`.
fn capitalise(s: &mut String, at: usize) {
    if let Some(c) = s[at..].chars().next() {
        let up = c.to_ascii_uppercase();
        s.replace_range(at..at + c.len_utf8(), up.encode_utf8(&mut [0; 4]));
    }
}

/// At least `min_bytes` of ASCII text: paragraphs of 3 to 7 sentences separated by blank
/// lines, identical for a given `seed`.
pub(crate) fn english_like(seed: u64, min_bytes: usize) -> Vec<u8> {
    let words = Words::new();
    let mut rng = Rng::new(seed);
    let mut out = String::with_capacity(min_bytes + 1024);
    while out.len() < min_bytes {
        let n = 3 + rng.below(5);
        for i in 0..n {
            if i > 0 {
                out.push(' ');
            }
            words.sentence(&mut rng, &mut out);
        }
        out.push_str("\n\n");
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_deterministic_ascii_sentences_of_a_few_hundred_words() {
        let a = super::english_like(3, 10_000);
        assert_eq!(a, super::english_like(3, 10_000));
        assert_ne!(a, super::english_like(4, 10_000));
        assert!(a.len() >= 10_000 && a.is_ascii());
        let text = String::from_utf8(a).unwrap();
        let vocab: std::collections::HashSet<&str> = text
            .split(|c: char| !c.is_ascii_alphabetic())
            .filter(|w| !w.is_empty())
            .collect();
        assert!((150..700).contains(&vocab.len()), "{} distinct words", vocab.len());
        assert!(text.contains(". ") && text.contains("\n\n"));
    }
}
