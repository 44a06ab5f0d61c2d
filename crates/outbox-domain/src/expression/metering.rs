//! The cost of one evaluation.
//!
//! The interpreter has no cost limit, and its overloads are plain `fn`s, so the limit is
//! laid over it: `meter` rewrites the tree so that every value an operation consumes
//! passes through `@cost`, which weighs it (bytes of a string, elements of a list, all
//! the way down) and charges the weight against the evaluation's budget before the
//! operation runs. An operation's work is linear in what it consumes, and what it
//! produces is consumed, hence weighed, by the next one; every iteration of a
//! comprehension is charged too. The total work is then within a constant factor of the
//! units charged, whatever the expression. Weighing a value costs as much as the units
//! it charges, and stops once those exceed what is left of the budget, so weighing stays
//! within the budget as well. The names of the metering functions start with `@`, which
//! CEL source cannot spell.

use std::{
    cell::{Cell, RefCell},
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use cel::{
    Env, ExecutionError,
    common::{
        ast::{
            CallExpr, EntryExpr, Expr, IdedEntryExpr, IdedExpr, ListExpr, LiteralValue, operators,
        },
        types::{CelBytes, CelInt, CelList, CelMap, CelOptional, CelString, DYN_TYPE, INT_TYPE},
        value::{CowVal, Val},
    },
};
use regex::{Regex, RegexBuilder};

use super::EXPRESSION_VARIABLES;
use crate::{event::Event, input::Echo};

/// Largest payload a transform may give when the caller names no limit: the gateway's
/// default `--max-payload-bytes` (`PublishLimits::default`).
pub const DEFAULT_MAX_TRANSFORM_BYTES: usize = 1024 * 1024;

/// Units every metered operation costs besides what it consumes: a call through the
/// interpreter (an overload looked up, its arguments collected) takes tens of
/// nanoseconds, as long as weighing a few dozen values.
const OPERATION_UNITS: u64 = 8;
/// Bytes of a string or bytes value weighing one unit: copying or scanning 8 bytes costs
/// about as much as touching one element of a list.
const BYTES_PER_UNIT: u64 = 8;
/// Units per byte a regular expression scans: a match step costs several times a plain
/// scan's.
const REGEX_UNITS_PER_BYTE: u64 = 1;
/// Units of compiling a pattern that is not a literal (read from the event): within
/// [`DYNAMIC_PATTERN_SIZE_LIMIT`], a compilation takes up to a millisecond or so.
const DYNAMIC_PATTERN_UNITS: u64 = 100_000;
/// Compiled size of a pattern that is not a literal: compiled for each evaluation, it
/// must be cheap to compile. Literal patterns, compiled once, may be as large as the
/// regex engine allows.
const DYNAMIC_PATTERN_SIZE_LIMIT: usize = 64 * 1024;
/// Budget of every evaluation, whatever its event: about a millisecond of work.
const BASE_BUDGET_UNITS: u64 = 200_000;
/// Budget per byte of the event's payload and metadata, so that an expression may still
/// go over all of a large event a few times (a comprehension over its items, say): the
/// claim reads and decodes those bytes anyway.
const BUDGET_UNITS_PER_EVENT_BYTE: u64 = 4;
/// The backstop of the budget: an evaluation still running after this many nanoseconds
/// per unit of its budget stops at its next charge. Units are calibrated at a few
/// nanoseconds each, so only work the weights do not see can reach it; it is checked
/// every [`DEADLINE_CHECK_EVERY`] charges, reading the clock costing more than a charge.
const DEADLINE_NANOS_PER_UNIT: u64 = if cfg!(debug_assertions) {
    // Unoptimised, the interpreter runs some twenty times slower.
    1000
} else {
    50
};
const DEADLINE_CHECK_EVERY: u32 = 32;

/// The function charging for the value it is given: `@cost(value, units)` charges
/// [`OPERATION_UNITS`], `units` (known when compiling: the weight of the literals beside
/// the value) and the value's weight, and gives the value back.
const COST: &str = "@cost";
/// `@step(value)`: charges [`OPERATION_UNITS`] only, for a value an operation does not
/// go through (a list indexed, a map a field is selected from).
const STEP: &str = "@step";
/// `@matches(text, index)`: `matches` with the literal pattern of that index, compiled
/// with the expression.
pub(super) const MATCHES_LITERAL: &str = "@matches";
/// `@matches_dynamic(text, pattern)`: `matches` with a pattern found while evaluating.
const MATCHES_DYNAMIC: &str = "@matches_dynamic";

/// The standard environment and the metering functions.
pub(super) fn metered_env() -> Env {
    let mut env = Env::stdlib();
    let declared = [
        env.add_overload(COST, COST, vec![DYN_TYPE, INT_TYPE], cost),
        env.add_overload(STEP, STEP, vec![DYN_TYPE], step),
        env.add_overload(
            MATCHES_LITERAL,
            MATCHES_LITERAL,
            vec![DYN_TYPE, INT_TYPE],
            matches_literal,
        ),
        env.add_overload(
            MATCHES_DYNAMIC,
            MATCHES_DYNAMIC,
            vec![DYN_TYPE, DYN_TYPE],
            matches_dynamic,
        ),
    ];
    for declaration in declared {
        declaration.expect("names CEL source cannot spell are free");
    }
    env
}

/// How an evaluation ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exhaustion {
    /// It spent its budget, of that many units.
    Budget(u64),
    /// It ran past the deadline of its budget, of that many units.
    Deadline(u64),
}

/// The budget of the evaluation running on this thread. Evaluations are synchronous and
/// the overloads are plain `fn`s, so a thread-local is where they find it.
pub(super) struct Meter {
    pub(super) active: Cell<bool>,
    spent: Cell<u64>,
    budget: Cell<u64>,
    charges: Cell<u32>,
    deadline: Cell<Option<Instant>>,
    exhausted: Cell<Option<Exhaustion>>,
    /// The literal patterns of the expression being evaluated.
    patterns: RefCell<Arc<[Pattern]>>,
}

thread_local! {
    pub(super) static METER: Meter = Meter {
        active: Cell::new(false),
        spent: Cell::new(0),
        budget: Cell::new(0),
        charges: Cell::new(0),
        deadline: Cell::new(None),
        exhausted: Cell::new(None),
        patterns: RefCell::new(Arc::from(Vec::new())),
    };
}

impl Meter {
    /// Charges `units`: an error once the budget is spent or the deadline passed, and
    /// for every charge after that, so the evaluation stops at its next operation.
    fn charge(&self, units: u64) -> std::result::Result<(), ExecutionError> {
        if !self.active.get() {
            return Ok(());
        }
        if self.exhausted.get().is_some() {
            return Err(exhausted_error());
        }
        let spent = self.spent.get().saturating_add(units);
        self.spent.set(spent);
        if spent > self.budget.get() {
            self.exhausted
                .set(Some(Exhaustion::Budget(self.budget.get())));
            return Err(exhausted_error());
        }
        let charges = self.charges.get().wrapping_add(1);
        self.charges.set(charges);
        if charges.is_multiple_of(DEADLINE_CHECK_EVERY)
            && self
                .deadline
                .get()
                .is_some_and(|deadline| Instant::now() > deadline)
        {
            self.exhausted
                .set(Some(Exhaustion::Deadline(self.budget.get())));
            return Err(exhausted_error());
        }
        Ok(())
    }

    /// Units left: how far weighing a value needs to go.
    fn remaining(&self) -> u64 {
        if !self.active.get() {
            return u64::MAX;
        }
        self.budget.get().saturating_sub(self.spent.get())
    }
}

/// What a charge over budget fails with; the evaluation's result says why in plain words
/// (see [`Failure`]).
fn exhausted_error() -> ExecutionError {
    ExecutionError::function_error("cost", "the evaluation's budget is spent")
}

/// The metering of one evaluation on this thread, ended when dropped (a panic included).
pub(super) struct Metering(std::marker::PhantomData<*const ()>);

impl Metering {
    pub(super) fn start(budget: u64, patterns: Arc<[Pattern]>) -> Self {
        let deadline = Instant::now().checked_add(deadline_for(budget));
        METER.with(|meter| {
            meter.active.set(true);
            meter.spent.set(0);
            meter.budget.set(budget);
            meter.charges.set(0);
            meter.deadline.set(deadline);
            meter.exhausted.set(None);
            *meter.patterns.borrow_mut() = patterns;
        });
        Metering(std::marker::PhantomData)
    }

    /// How the evaluation ran out, if it did, and the units it spent.
    pub(super) fn finish(self) -> (Option<Exhaustion>, u64) {
        METER.with(|meter| (meter.exhausted.get(), meter.spent.get()))
    }
}

impl Drop for Metering {
    fn drop(&mut self) {
        METER.with(|meter| {
            meter.active.set(false);
            *meter.patterns.borrow_mut() = Arc::from(Vec::new());
        });
    }
}

/// How long an evaluation with `budget` may run: see [`DEADLINE_NANOS_PER_UNIT`].
pub(super) fn deadline_for(budget: u64) -> Duration {
    Duration::from_nanos(budget.saturating_mul(DEADLINE_NANOS_PER_UNIT))
}

/// The budget of an evaluation against `event`.
pub(super) fn budget_for(event: &Event) -> u64 {
    let metadata: usize = event
        .metadata
        .iter()
        .map(|(key, value)| key.len() + value.len())
        .sum();
    let bytes = (event.payload.len() + metadata) as u64;
    BASE_BUDGET_UNITS.saturating_add(bytes.saturating_mul(BUDGET_UNITS_PER_EVENT_BYTE))
}

/// The weight of `value` in units, counted no further than past `limit`.
fn weigh(value: &dyn Val, limit: u64) -> u64 {
    if let Some(text) = value.downcast_ref::<CelString>() {
        return 1 + text.inner().len() as u64 / BYTES_PER_UNIT;
    }
    if let Some(bytes) = value.downcast_ref::<CelBytes>() {
        return 1 + bytes.inner().len() as u64 / BYTES_PER_UNIT;
    }
    let mut weight = 1u64;
    if let Some(list) = value.downcast_ref::<CelList>() {
        for item in list.inner() {
            if weight > limit {
                break;
            }
            weight = weight.saturating_add(weigh(item.as_ref(), limit - weight));
        }
    } else if let Some(map) = value.downcast_ref::<CelMap>() {
        for (key, item) in map.inner() {
            if weight > limit {
                break;
            }
            weight = weight.saturating_add(weigh(key.inner(), limit - weight));
            weight = weight.saturating_add(weigh(item.as_ref(), limit.saturating_sub(weight)));
        }
    } else if let Some(inner) = value
        .downcast_ref::<CelOptional>()
        .and_then(|optional| optional.inner())
    {
        weight = weight.saturating_add(weigh(inner, limit - weight));
    }
    weight
}

/// `@cost(value, units)`: see [`COST`].
pub(super) fn cost<'b, 'v>(
    mut args: Vec<CowVal<'b, 'v>>,
) -> std::result::Result<CowVal<'b, 'v>, ExecutionError> {
    let units = args
        .get(1)
        .and_then(|units| units.downcast_ref::<CelInt>())
        .map_or(0, |units| u64::try_from(*units.inner()).unwrap_or(0));
    METER.with(|meter| {
        let weight = weigh(args[0].as_ref(), meter.remaining());
        meter.charge(OPERATION_UNITS + units + weight)
    })?;
    Ok(args.swap_remove(0))
}

/// `@step(value)`: see [`STEP`].
fn step<'b, 'v>(
    mut args: Vec<CowVal<'b, 'v>>,
) -> std::result::Result<CowVal<'b, 'v>, ExecutionError> {
    METER.with(|meter| meter.charge(OPERATION_UNITS))?;
    Ok(args.swap_remove(0))
}

/// The text `matches` runs on, or the error `matches` gives for another type.
fn match_text<'a>(args: &'a [CowVal<'_, '_>]) -> std::result::Result<&'a str, ExecutionError> {
    args[0]
        .downcast_ref::<CelString>()
        .map(|text| text.inner())
        .ok_or_else(|| {
            ExecutionError::no_such_overload(
                "matches",
                args.iter()
                    .map(|arg| arg.get_type().name().to_owned())
                    .collect(),
            )
        })
}

/// `@matches(text, index)`: see [`MATCHES_LITERAL`].
fn matches_literal<'b, 'v>(
    args: Vec<CowVal<'b, 'v>>,
) -> std::result::Result<CowVal<'b, 'v>, ExecutionError> {
    let text = match_text(&args)?;
    let index = args[1]
        .downcast_ref::<CelInt>()
        .and_then(|index| usize::try_from(*index.inner()).ok())
        .unwrap_or(usize::MAX);
    let found = METER.with(|meter| {
        meter.charge(OPERATION_UNITS + text.len() as u64 * REGEX_UNITS_PER_BYTE)?;
        let patterns = meter.patterns.borrow();
        match patterns.get(index).map(|pattern| &pattern.regex) {
            Some(Ok(regex)) => Ok(regex.is_match(text)),
            Some(Err(reason)) => Err(ExecutionError::function_error("matches", reason)),
            None => Err(ExecutionError::function_error(
                "matches",
                "the pattern was not compiled with the expression",
            )),
        }
    })?;
    Ok(CowVal::owned(cel::common::types::CelBool::from(found)))
}

/// `@matches_dynamic(text, pattern)`: see [`MATCHES_DYNAMIC`].
fn matches_dynamic<'b, 'v>(
    args: Vec<CowVal<'b, 'v>>,
) -> std::result::Result<CowVal<'b, 'v>, ExecutionError> {
    let text = match_text(&args)?;
    let Some(pattern) = args[1].downcast_ref::<CelString>().map(|p| p.inner()) else {
        return Err(ExecutionError::no_such_overload(
            "matches",
            args.iter()
                .map(|arg| arg.get_type().name().to_owned())
                .collect(),
        ));
    };
    METER.with(|meter| {
        meter.charge(
            OPERATION_UNITS
                + DYNAMIC_PATTERN_UNITS
                + (text.len() + pattern.len()) as u64 * REGEX_UNITS_PER_BYTE,
        )
    })?;
    let regex = RegexBuilder::new(pattern)
        .size_limit(DYNAMIC_PATTERN_SIZE_LIMIT)
        .build()
        .map_err(|error| {
            ExecutionError::function_error(
                "matches",
                pattern_error(pattern, &error, DYNAMIC_PATTERN_SIZE_LIMIT),
            )
        })?;
    Ok(CowVal::owned(cel::common::types::CelBool::from(
        regex.is_match(text),
    )))
}

/// A literal `matches` pattern, compiled once with its expression.
pub(super) struct Pattern {
    /// The `matches` call it is the pattern of, for the position of a refusal.
    pub(super) id: u64,
    /// The compiled pattern, or why the regex engine refused it.
    pub(super) regex: std::result::Result<Arc<Regex>, String>,
}

/// Most patterns kept compiled for the whole process: definitions are compiled again
/// each time they are read, and a large pattern takes a tenth of a second to compile.
const MAX_SHARED_PATTERNS: usize = 1024;

/// Compiled patterns shared by every expression holding them, by pattern text.
static SHARED_PATTERNS: std::sync::LazyLock<Mutex<HashMap<String, Arc<Regex>>>> =
    std::sync::LazyLock::new(Mutex::default);

impl Pattern {
    pub(super) fn compile(id: u64, text: String) -> Self {
        let shared = |patterns: &mut HashMap<String, Arc<Regex>>| patterns.get(&text).cloned();
        let known = shared(&mut SHARED_PATTERNS.lock().unwrap_or_else(|p| p.into_inner()));
        let regex = match known {
            Some(regex) => Ok(regex),
            // Compiled outside the lock: it may take long.
            None => RegexBuilder::new(&text)
                .build()
                .map(Arc::new)
                .map_err(|error| pattern_error(&text, &error, LITERAL_PATTERN_SIZE_LIMIT))
                .inspect(|regex| {
                    let mut patterns = SHARED_PATTERNS.lock().unwrap_or_else(|p| p.into_inner());
                    if patterns.len() < MAX_SHARED_PATTERNS {
                        patterns.insert(text.clone(), Arc::clone(regex));
                    }
                }),
        };
        Pattern { id, regex }
    }
}

/// The regex engine's own limit on a compiled pattern (`RegexBuilder::size_limit`'s
/// default), which literal patterns are compiled with: a pattern is refused exactly when
/// the engine could never run it.
const LITERAL_PATTERN_SIZE_LIMIT: usize = 10 * (1 << 20);

/// Why the regex engine refused `pattern`, in plain words.
fn pattern_error(pattern: &str, error: &regex::Error, size_limit: usize) -> String {
    let quoted = Echo(pattern);
    match error {
        regex::Error::Syntax(message) => {
            let reason = message
                .lines()
                .rev()
                .find_map(|line| line.trim().strip_prefix("error: "))
                .unwrap_or("cannot be parsed");
            format!("the pattern {quoted} is not a valid regular expression: {reason}")
        }
        regex::Error::CompiledTooBig(_) => format!(
            "the pattern {quoted} compiles to more than the regular expression engine's \
             limit of {} KiB: a Unicode class such as \\w, \\d or \\s repeated many times is \
             large; use an ASCII class such as [A-Za-z0-9_] or (?-u:\\w), or fewer repetitions",
            size_limit / 1024
        ),
        other => format!("the pattern {quoted} cannot be compiled: {other}"),
    }
}

/// The metered copy of `expr` that evaluations run (see the section's comment), and the
/// literal `matches` patterns it names, with the ids of their calls.
pub(super) fn meter(expr: &IdedExpr, patterns: &mut Vec<(u64, String)>) -> IdedExpr {
    Metered {
        patterns,
        bound: Vec::new(),
    }
    .expr(expr)
}

/// Rewrites an expression into its metered copy.
struct Metered<'a> {
    patterns: &'a mut Vec<(u64, String)>,
    /// The variables of the comprehensions around the node rewritten.
    bound: Vec<String>,
}

impl Metered<'_> {
    fn expr(&mut self, expr: &IdedExpr) -> IdedExpr {
        let rewritten = match &expr.expr {
            Expr::Unspecified | Expr::Literal(_) | Expr::Ident(_) => expr.expr.clone(),
            // Selecting a field costs the same whatever the value it is selected from.
            Expr::Select(select) => Expr::Select(cel::common::ast::SelectExpr {
                operand: Box::new(self.expr(&select.operand)),
                field: select.field.clone(),
                test: select.test,
            }),
            Expr::Call(call) => return self.call(expr.id, call),
            Expr::List(list) => Expr::List(ListExpr {
                elements: list
                    .elements
                    .iter()
                    .map(|element| self.consumed(element, 0))
                    .collect(),
                optional_indices: list.optional_indices.clone(),
            }),
            Expr::Map(map) => Expr::Map(cel::common::ast::MapExpr {
                entries: self.entries(&map.entries),
            }),
            Expr::Struct(structure) => Expr::Struct(cel::common::ast::StructExpr {
                type_name: structure.type_name.clone(),
                entries: self.entries(&structure.entries),
            }),
            Expr::Comprehension(comprehension) => {
                Expr::Comprehension(Box::new(self.comprehension(comprehension)))
            }
        };
        IdedExpr {
            id: expr.id,
            expr: rewritten,
        }
    }

    /// `expr`, charged for as an operation consumes it (a literal is weighed by the
    /// operation's `units` instead).
    fn consumed(&mut self, expr: &IdedExpr, units: u64) -> IdedExpr {
        let rewritten = self.expr(expr);
        if matches!(expr.expr, Expr::Literal(_)) && units == 0 {
            return rewritten;
        }
        charged(COST, rewritten, Some(units))
    }

    fn entries(&mut self, entries: &[IdedEntryExpr]) -> Vec<IdedEntryExpr> {
        entries
            .iter()
            .map(|entry| IdedEntryExpr {
                id: entry.id,
                expr: match &entry.expr {
                    EntryExpr::StructField(field) => {
                        EntryExpr::StructField(cel::common::ast::StructFieldExpr {
                            field: field.field.clone(),
                            value: self.consumed(&field.value, 0),
                            optional: field.optional,
                        })
                    }
                    EntryExpr::MapEntry(entry) => {
                        EntryExpr::MapEntry(cel::common::ast::MapEntryExpr {
                            key: self.consumed(&entry.key, 0),
                            value: self.consumed(&entry.value, 0),
                            optional: entry.optional,
                        })
                    }
                },
            })
            .collect()
    }

    fn call(&mut self, id: u64, call: &CallExpr) -> IdedExpr {
        let call_with = |func_name: &str, target, args| IdedExpr {
            id,
            expr: Expr::Call(CallExpr {
                func_name: func_name.to_owned(),
                target,
                args,
            }),
        };
        match call.func_name.as_str() {
            // Control flow on booleans: constant work, and their operands are charged
            // where they are computed.
            operators::LOGICAL_AND
            | operators::LOGICAL_OR
            | operators::CONDITIONAL
            | operators::LOGICAL_NOT
            | operators::NOT_STRICTLY_FALSE => {
                let args = call.args.iter().map(|arg| self.expr(arg)).collect();
                return call_with(&call.func_name, None, args);
            }
            // Indexing and optional selection look one element up: the container is
            // not gone through, and weighing it would charge the size of a list for
            // each lookup.
            operators::INDEX | operators::OPT_INDEX | operators::OPT_SELECT
                if call.args.len() == 2 && call.target.is_none() =>
            {
                let container = charged(STEP, self.expr(&call.args[0]), None);
                let key = self.consumed(&call.args[1], 0);
                return call_with(&call.func_name, None, vec![container, key]);
            }
            "matches" => {
                if let Some(matches) = self.matches(id, call) {
                    return matches;
                }
            }
            _ => {}
        }
        // Every operand is weighed as the operation consumes it; literals by the units
        // the first charge carries.
        let literal_units: u64 = call
            .target
            .iter()
            .map(|target| &**target)
            .chain(&call.args)
            .filter_map(|operand| match &operand.expr {
                Expr::Literal(literal) => Some(literal_weight(literal)),
                _ => None,
            })
            .sum();
        let mut units = Some(literal_units);
        let mut operand = |metered: &mut Self, operand: &IdedExpr| {
            if matches!(operand.expr, Expr::Literal(_)) {
                return metered.expr(operand);
            }
            metered.consumed(operand, units.take().unwrap_or(0))
        };
        let target = call.target.as_ref().map(|target| {
            Box::new(match self.names_a_namespace(target) {
                true => self.expr(target),
                false => operand(self, target),
            })
        });
        let args = call.args.iter().map(|arg| operand(self, arg)).collect();
        let rewritten = call_with(&call.func_name, target, args);
        match units {
            // Only literals: the call itself is charged, with their weight.
            Some(units) => charged(COST, rewritten, Some(units)),
            None => rewritten,
        }
    }

    /// `text.matches(pattern)` or `matches(text, pattern)` as a call to the literal
    /// pattern compiled with the expression, or to one compiled when evaluated.
    fn matches(&mut self, id: u64, call: &CallExpr) -> Option<IdedExpr> {
        let (text, pattern) = match (&call.target, call.args.as_slice()) {
            (Some(target), [pattern]) => (&**target, pattern),
            (None, [text, pattern]) => (text, pattern),
            _ => return None,
        };
        // `@matches` charges for the text it scans.
        let text = self.expr(text);
        let (func_name, pattern) = match &pattern.expr {
            Expr::Literal(LiteralValue::String(literal)) => {
                let index = self.patterns.len();
                self.patterns.push((id, literal.inner().to_owned()));
                (MATCHES_LITERAL, int_literal(pattern.id, index as u64))
            }
            _ => (MATCHES_DYNAMIC, self.expr(pattern)),
        };
        Some(IdedExpr {
            id,
            expr: Expr::Call(CallExpr {
                func_name: func_name.to_owned(),
                target: None,
                args: vec![text, pattern],
            }),
        })
    }

    /// Whether `target` spells a namespace (`optional` in `optional.of(x)`), which a call
    /// on it names a function of, rather than a value.
    fn names_a_namespace(&self, target: &IdedExpr) -> bool {
        let mut expr = target;
        loop {
            match &expr.expr {
                Expr::Ident(name) => {
                    return !EXPRESSION_VARIABLES.contains(&name.as_str())
                        && !self.bound.iter().any(|bound| bound == name);
                }
                Expr::Select(select) if !select.test => expr = &select.operand,
                _ => return false,
            }
        }
    }

    /// A comprehension whose range is weighed once and each iteration charged, with its
    /// step kept in the shapes the interpreter recognises (`@result && x`,
    /// `@result + [x]`, `guard ? step : @result`) so that it appends in place and
    /// short-circuits as before.
    fn comprehension(
        &mut self,
        comprehension: &cel::common::ast::ComprehensionExpr,
    ) -> cel::common::ast::ComprehensionExpr {
        let iter_range = self.consumed(&comprehension.iter_range, 0);
        let accu_init = self.expr(&comprehension.accu_init);
        let bound_before = self.bound.len();
        self.bound.push(comprehension.iter_var.clone());
        self.bound.extend(comprehension.iter_var2.clone());
        self.bound.push(comprehension.accu_var.clone());
        let loop_cond = self.expr(&comprehension.loop_cond);
        let loop_step = self.loop_step(&comprehension.loop_step, &comprehension.accu_var);
        let result = self.expr(&comprehension.result);
        self.bound.truncate(bound_before);
        cel::common::ast::ComprehensionExpr {
            iter_range,
            iter_var: comprehension.iter_var.clone(),
            iter_var2: comprehension.iter_var2.clone(),
            accu_var: comprehension.accu_var.clone(),
            accu_init,
            loop_cond,
            loop_step,
            result,
        }
    }

    /// A comprehension's step, in which what each iteration computes is charged, even a
    /// literal: each iteration costs at least one charge.
    fn loop_step(&mut self, step: &IdedExpr, accu: &str) -> IdedExpr {
        let is_accu = |expr: &IdedExpr| matches!(&expr.expr, Expr::Ident(name) if name == accu);
        let Expr::Call(call) = &step.expr else {
            return match is_accu(step) {
                true => step.clone(),
                false => self.per_iteration(step),
            };
        };
        let args: Vec<IdedExpr> = match (call.func_name.as_str(), call.args.as_slice()) {
            (
                operators::LOGICAL_AND | operators::LOGICAL_OR | operators::ADD,
                [accumulator, operand],
            ) if call.target.is_none() && is_accu(accumulator) => {
                let operand = match &operand.expr {
                    Expr::List(list) if call.func_name == operators::ADD => IdedExpr {
                        id: operand.id,
                        expr: Expr::List(ListExpr {
                            elements: list
                                .elements
                                .iter()
                                .map(|element| self.per_iteration(element))
                                .collect(),
                            optional_indices: list.optional_indices.clone(),
                        }),
                    },
                    _ => self.per_iteration(operand),
                };
                vec![accumulator.clone(), operand]
            }
            (operators::CONDITIONAL, [guard, then, otherwise]) if call.target.is_none() => vec![
                self.per_iteration(guard),
                self.loop_step(then, accu),
                self.loop_step(otherwise, accu),
            ],
            _ => return self.per_iteration(step),
        };
        IdedExpr {
            id: step.id,
            expr: Expr::Call(CallExpr {
                func_name: call.func_name.clone(),
                target: None,
                args,
            }),
        }
    }

    fn per_iteration(&mut self, expr: &IdedExpr) -> IdedExpr {
        charged(COST, self.expr(expr), Some(0))
    }
}

/// `function(expr, units)`, or `function(expr)` without units.
pub(super) fn charged(function: &str, expr: IdedExpr, units: Option<u64>) -> IdedExpr {
    let id = expr.id;
    let mut args = vec![expr];
    args.extend(units.map(|units| int_literal(id, units)));
    IdedExpr {
        id,
        expr: Expr::Call(CallExpr {
            func_name: function.to_owned(),
            target: None,
            args,
        }),
    }
}

fn int_literal(id: u64, value: u64) -> IdedExpr {
    IdedExpr {
        id,
        expr: Expr::Literal(LiteralValue::Int(CelInt::from(
            i64::try_from(value).unwrap_or(i64::MAX),
        ))),
    }
}

/// The weight of a literal, as [`weigh`] would find it.
fn literal_weight(literal: &LiteralValue) -> u64 {
    match literal {
        LiteralValue::String(text) => 1 + text.inner().len() as u64 / BYTES_PER_UNIT,
        LiteralValue::Bytes(bytes) => 1 + bytes.inner().len() as u64 / BYTES_PER_UNIT,
        _ => 1,
    }
}
