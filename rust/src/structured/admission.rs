//! What a compiled grammar must satisfy before a request may use it: every rule it can reach
//! can complete, and no parser row it can build outgrows llguidance's limit (which llguidance
//! itself only checks after a token, mid-request).
//!
//! Both checks walk the compiled Earley grammar once from its start symbol. Parametric rule
//! conditions are ignored, so a rule counts as usable whenever some condition could allow it:
//! the checks may admit a grammar that fails later, never refuse one that works.

use llguidance::earley::{CGrammar, CSymIdx};
use llguidance::HashMap;

/// Why a grammar is refused; the compiler words it for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The named rule can never be completed (every alternative needs itself, or another rule
    /// that cannot complete); when it is the start rule, the grammar matches nothing.
    Unproductive { rule: String, is_start: bool },
    /// Predicting the named rule puts more than `limit` items in one parser row.
    RowTooLarge { rule: String, limit: usize },
    /// The check itself would take more than its fuel: the grammar is too large to admit.
    TooComplex,
}

/// Edge visits the row-size check may spend (about a second's work in the worst case).
const CHECK_FUEL: usize = 50_000_000;

/// The reachable part of a compiled grammar: nonterminals and, for each, its rules' symbols.
struct Reachable<'a> {
    grammar: &'a CGrammar,
    /// Reachable symbols, start first.
    symbols: Vec<CSymIdx>,
    index: HashMap<CSymIdx, usize>,
}

impl<'a> Reachable<'a> {
    fn new(grammar: &'a CGrammar) -> Self {
        let mut reach = Reachable {
            grammar,
            symbols: vec![grammar.start()],
            index: HashMap::default(),
        };
        reach.index.insert(grammar.start(), 0);
        let mut next = 0;
        while next < reach.symbols.len() {
            let sym = reach.symbols[next];
            next += 1;
            for r in 0..grammar.rules_of(sym).len() {
                for &s in reach.rhs(sym, r) {
                    if !reach.index.contains_key(&s) {
                        reach.index.insert(s, reach.symbols.len());
                        reach.symbols.push(s);
                    }
                }
            }
        }
        reach
    }

    /// The right-hand side of the `r`-th rule of `sym`.
    fn rhs(&self, sym: CSymIdx, r: usize) -> &'a [CSymIdx] {
        let rule = self.grammar.rules_of(sym)[r];
        let (rhs, _, _) = self.grammar.rule_rhs(rule);
        rhs
    }

    /// Completes without consuming input (always or under some condition).
    fn nullable(&self, sym: CSymIdx) -> bool {
        let data = self.grammar.sym_data(sym);
        data.is_nullable || !data.cond_nullable.is_empty()
    }

    /// Derives text by itself: a lexeme, or a nested grammar (checked on its own).
    fn leaf(&self, sym: CSymIdx) -> bool {
        let data = self.grammar.sym_data(sym);
        data.is_terminal || data.gen_grammar.is_some()
    }

    fn name(&self, sym: CSymIdx) -> String {
        self.grammar.sym_data(sym).name.clone()
    }
}

/// The size of the reachable grammar, for an estimate of its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarSize {
    pub symbols: usize,
    /// Symbols in all rules' right-hand sides.
    pub rule_symbols: usize,
}

/// Checks the grammar; `max_items_in_row` is the parser's row limit.
pub fn check(grammar: &CGrammar, max_items_in_row: usize) -> Result<GrammarSize, Refusal> {
    let reach = Reachable::new(grammar);
    check_productive(&reach)?;
    check_row_sizes(&reach, max_items_in_row)?;
    let rule_symbols = reach
        .symbols
        .iter()
        .map(|&sym| {
            (0..grammar.rules_of(sym).len())
                .map(|r| reach.rhs(sym, r).len())
                .sum::<usize>()
        })
        .sum();
    Ok(GrammarSize {
        symbols: reach.symbols.len(),
        rule_symbols,
    })
}

/// Every reachable symbol derives some text: a worklist fixpoint, linear in the grammar.
fn check_productive(reach: &Reachable<'_>) -> Result<(), Refusal> {
    let n = reach.symbols.len();
    let mut productive = vec![false; n];
    // For each rule (symbol index, rule number): its symbols not yet known productive.
    let mut missing: Vec<usize> = Vec::new();
    let mut rule_owner: Vec<usize> = Vec::new();
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut ready: Vec<usize> = Vec::new();
    for (i, &sym) in reach.symbols.iter().enumerate() {
        if reach.leaf(sym) || reach.nullable(sym) {
            productive[i] = true;
            ready.push(i);
        }
    }
    for (i, &sym) in reach.symbols.iter().enumerate() {
        for r in 0..reach.grammar.rules_of(sym).len() {
            let rule = missing.len();
            let rhs = reach.rhs(sym, r);
            for s in rhs {
                users[reach.index[s]].push(rule);
            }
            missing.push(rhs.len());
            rule_owner.push(i);
        }
    }
    while let Some(i) = ready.pop() {
        for &rule in &users[i] {
            missing[rule] -= 1;
            let owner = rule_owner[rule];
            if missing[rule] == 0 && !productive[owner] {
                productive[owner] = true;
                ready.push(owner);
            }
        }
    }
    // The start symbol first: an empty language is the clearer message.
    match productive.iter().position(|&p| !p) {
        None => Ok(()),
        Some(i) => Err(Refusal::Unproductive {
            rule: reach.name(reach.symbols[i]),
            is_start: i == 0,
        }),
    }
}

/// A row holds, for a predicted symbol, the items of every rule reachable by prediction:
/// its rules, then the rules of each rule's first symbol, through nullable prefixes.
fn check_row_sizes(reach: &Reachable<'_>, limit: usize) -> Result<(), Refusal> {
    let n = reach.symbols.len();
    // Items each symbol's own rules add to a row, and its prediction successors.
    let mut own_items = vec![0usize; n];
    let mut predicts: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, &sym) in reach.symbols.iter().enumerate() {
        if reach.leaf(sym) {
            continue;
        }
        for r in 0..reach.grammar.rules_of(sym).len() {
            own_items[i] += 1;
            for s in reach.rhs(sym, r) {
                if !reach.leaf(*s) {
                    predicts[i].push(reach.index[s]);
                }
                if !reach.nullable(*s) {
                    break;
                }
                own_items[i] += 1; // the item past the nullable symbol
            }
        }
    }
    let mut fuel = CHECK_FUEL;
    let mut seen = vec![usize::MAX; n]; // the search that last visited each symbol
    let mut stack = Vec::new();
    for root in 0..n {
        if reach.leaf(reach.symbols[root]) {
            continue;
        }
        let mut items = 0;
        stack.clear();
        stack.push(root);
        seen[root] = root;
        while let Some(i) = stack.pop() {
            items += own_items[i];
            if items > limit {
                return Err(Refusal::RowTooLarge {
                    rule: reach.name(reach.symbols[root]),
                    limit,
                });
            }
            for &j in &predicts[i] {
                fuel = fuel.checked_sub(1).ok_or(Refusal::TooComplex)?;
                if seen[j] != root {
                    seen[j] = root;
                    stack.push(j);
                }
            }
        }
    }
    Ok(())
}
