//! CEL expressions over events: a subscription's `filter` (which events it receives) and
//! `transform` (what payload they carry). Parsing, the checks made when one is set, and
//! evaluation against one event.
//!
//! Cost is bounded twice. Before an expression is stored: its length, its size in nodes,
//! comprehensions (`all`, `exists`, `map`, `filter`…) whose bodies may not read `payload`
//! nor loop again, and every literal `matches` pattern compiled (refused when the regex
//! engine cannot compile it). While it runs: the `cel` crate has no cost limit of its own,
//! so the tree it interprets is a metered copy of the expression ([`meter`]), in which
//! every value an operation consumes is weighed and charged against a budget that grows
//! with the size of the event ([`metering`]), as cel-go's cost limit does. An evaluation
//! over budget stops at its next charge and is an evaluation error — counted as a filter
//! error, or dead-lettering for a transform — never a stall. A panic inside the
//! interpreter is caught and is an evaluation error too.
//!
//! CEL has no static types here (the crate interprets), so a type error is found by
//! evaluating the expression against sample events that differ only in the shape of
//! their payload: it is refused when it fails with a type error on every one of them.

use std::{
    collections::{BTreeSet, HashMap},
    fmt,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::Arc,
};

use cel::{
    Context, Env, ExecutionError, Program, Value,
    common::ast::{EntryExpr, Expr, IdedExpr},
    parser::ParseError,
};
use chrono::{DateTime, Utc};

pub use metering::DEFAULT_MAX_TRANSFORM_BYTES;
use metering::{Exhaustion, Metering, Pattern, budget_for, deadline_for, meter, metered_env};

mod metering;

use super::{
    event::{Event, is_json_content_type},
    input::check_text,
    refusal::{Refusal, Result},
};

/// Longest expression, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 4096;
/// Most nodes of an expression once its macros are expanded.
const MAX_EXPRESSION_NODES: usize = 1000;
/// Deepest nesting of an expression once its macros are expanded. The interpreter
/// recurses once per level (twice where its metering wraps an operand), on the stack of
/// the thread evaluating it; the parser bounds parenthesised nesting only, not a long
/// chain such as `a + b + c + …`.
const MAX_EXPRESSION_DEPTH: usize = 50;

/// The variables an expression sees, with what they hold.
pub const EXPRESSION_VARIABLES: [&str; 14] = [
    "id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "source",
    "metadata",
    "occurred_at",
    "created_at",
    "deliver_at",
    "expires_at",
    "content_type",
    "transaction_id",
    "payload",
];

thread_local! {
    /// The standard environment and the metering functions, built once per thread:
    /// building it is far costlier than an evaluation.
    static ENV: Arc<Env> = Arc::new(metered_env());
}

/// Why an expression could not be evaluated against one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvaluationError(pub String);

impl fmt::Display for EvaluationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A checked CEL expression and its source text.
#[derive(Clone)]
struct Expression {
    text: String,
    /// The parsed expression: where each node was written, for messages.
    program: Arc<Program>,
    /// What is evaluated: the expression with every operation metered (see [`meter`]).
    metered: Arc<IdedExpr>,
    /// Its literal `matches` patterns, compiled once, indexed as the metered tree's
    /// `@matches` calls name them.
    patterns: Arc<[Pattern]>,
    /// The variables it reads, found once: evaluations bind only these.
    variables: Vec<&'static str>,
}

impl Expression {
    /// Parses an expression being set, with every check: size, names, patterns, types.
    fn parse(field: &str, text: &str, kind: Kind) -> Result<Self> {
        if text.trim().is_empty() {
            return Err(Refusal::invalid(field, "is empty"));
        }
        // Refused here, not by the database: `validate_only` must answer as the real
        // call does.
        check_text(field, text)?;
        if text.len() > MAX_EXPRESSION_BYTES {
            return Err(Refusal::invalid(
                field,
                format!(
                    "is {} bytes long; at most {MAX_EXPRESSION_BYTES} are allowed",
                    text.len()
                ),
            ));
        }
        let (expression, shape) = Expression::compile(field, text)?;
        if shape.nodes > MAX_EXPRESSION_NODES {
            return Err(Refusal::invalid(
                field,
                format!(
                    "has {} nodes once expanded; at most {MAX_EXPRESSION_NODES} are allowed",
                    shape.nodes
                ),
            ));
        }
        let depth = depth(expression.program.expression());
        if depth > MAX_EXPRESSION_DEPTH {
            return Err(Refusal::invalid(
                field,
                format!(
                    "is nested {depth} levels deep once expanded; at most \
                     {MAX_EXPRESSION_DEPTH} are allowed"
                ),
            ));
        }
        if let Some((id, name)) = shape.identifiers.iter().find(|(_, name)| {
            !EXPRESSION_VARIABLES.contains(&name.as_str()) && !shape.bound.contains(name.as_str())
        }) {
            return Err(Refusal::invalid(
                field,
                format!(
                    "{}undeclared reference to {name:?}; the variables are {}",
                    position(&expression.program, *id),
                    EXPRESSION_VARIABLES.join(", ")
                ),
            ));
        }
        expression.check_patterns(field)?;
        expression.check_types(field, kind)?;
        Ok(expression)
    }

    /// Compiles `text` and walks it: what the checks of [`Expression::parse`] look at,
    /// and all an expression stored after them needs. A literal pattern the regex engine
    /// refuses is kept as the error its evaluations give, so that a definition stored
    /// before patterns were checked stays readable.
    fn compile(field: &str, text: &str) -> Result<(Self, Shape)> {
        let program = ENV
            .with(|env| env.compile(text))
            .map_err(|errors| Refusal::invalid(field, syntax_error(&errors.errors)))?;
        let mut shape = Shape::default();
        shape
            .walk(program.expression(), false)
            .map_err(|(id, reason)| {
                Refusal::invalid(field, format!("{}{reason}", position(&program, id)))
            })?;
        let mut literal_patterns = Vec::new();
        let metered = meter(program.expression(), &mut literal_patterns);
        let expression = Expression {
            text: text.to_owned(),
            variables: EXPRESSION_VARIABLES
                .into_iter()
                .filter(|variable| shape.identifiers.iter().any(|(_, name)| name == variable))
                .collect(),
            metered: Arc::new(metered),
            patterns: literal_patterns
                .into_iter()
                .map(|(id, text)| Pattern::compile(id, text))
                .collect(),
            program: Arc::new(program),
        };
        Ok((expression, shape))
    }

    /// Refuses a literal pattern the regex engine cannot compile: every evaluation would
    /// fail on it.
    fn check_patterns(&self, field: &str) -> Result<()> {
        match self.patterns.iter().find(|pattern| pattern.regex.is_err()) {
            Some(Pattern {
                id,
                regex: Err(reason),
                ..
            }) => Err(Refusal::invalid(
                field,
                format!("{}{reason}", position(&self.program, *id)),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses the expression when it fails with a type error, or gives a value of the
    /// wrong kind, on every sample event.
    fn check_types(&self, field: &str, kind: Kind) -> Result<()> {
        let samples = [
            serde_json::json!({}),
            serde_json::json!([]),
            serde_json::json!(""),
            serde_json::json!(0),
            serde_json::json!(true),
            serde_json::Value::Null,
        ];
        let mut first_refusal = None;
        for payload in samples {
            let event = sample_event(&payload);
            let refusal = match self.evaluate(&event) {
                Ok(value) if kind.accepts(&value) => return Ok(()),
                Ok(value) => format!("{} gives {}", kind.must_give(), value.type_of()),
                Err(Failure::Execution(error)) if !is_type_error(&error) => return Ok(()),
                Err(Failure::Execution(error)) => {
                    format!("{}{error}", self.position_of(&error))
                }
                // Samples are tiny: an expression that cannot finish on them never will.
                Err(failure) => failure.to_string(),
            };
            first_refusal.get_or_insert(refusal);
        }
        Err(Refusal::invalid(
            field,
            first_refusal.expect("at least one sample"),
        ))
    }

    /// `line:column: ` of the node an execution error is about, when it can be told.
    fn position_of(&self, error: &ExecutionError) -> String {
        let name = match error {
            ExecutionError::UndeclaredReference(name) => name.as_str(),
            ExecutionError::NoSuchOverload(overload) => overload.function(),
            _ => return String::new(),
        };
        find_call_or_ident(self.program.expression(), name)
            .map(|id| position(&self.program, id))
            .unwrap_or_default()
    }

    /// Evaluates the metered expression against `event` within the event's budget.
    fn evaluate(&self, event: &Event) -> std::result::Result<Value, Failure> {
        self.evaluate_metered(event).0
    }

    /// [`Expression::evaluate`], and the units it spent.
    fn evaluate_metered(&self, event: &Event) -> (std::result::Result<Value, Failure>, u64) {
        let budget = budget_for(event);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            ENV.with(|env| {
                let mut context = Context::with_env(Arc::clone(env));
                for &name in &self.variables {
                    context.add_variable_from_value(name, variable(event, name));
                }
                let metering = Metering::start(budget, Arc::clone(&self.patterns));
                let result = Value::resolve(&self.metered, &context);
                let (exhausted, spent) = metering.finish();
                // An exhausted budget fails the evaluation even where `||` or `&&`
                // absorbed the error of the charge that found it.
                let result = match exhausted {
                    Some(exhaustion) => Err(Failure::Exhausted(exhaustion)),
                    None => result.map_err(Failure::Execution),
                };
                (result, spent)
            })
        }));
        outcome.unwrap_or_else(|panic| (Err(Failure::Panicked(panic_message(&*panic))), 0))
    }
}

/// Why an evaluation gave no value.
#[derive(Debug)]
enum Failure {
    /// The expression failed on the event: a missing field, a type mismatch…
    Execution(ExecutionError),
    /// It would have cost more than the event's budget.
    Exhausted(Exhaustion),
    /// The interpreter panicked; the message it panicked with.
    Panicked(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Execution(error) => write!(f, "{error}"),
            Failure::Exhausted(Exhaustion::Budget(budget)) => write!(
                f,
                "the evaluation exceeded its cost budget ({budget} units for this event): \
                 the expression does too much work for one event"
            ),
            Failure::Exhausted(Exhaustion::Deadline(budget)) => write!(
                f,
                "the evaluation took longer than {} ms, the deadline of its budget \
                 ({budget} units for this event), and was stopped",
                deadline_for(*budget).as_millis()
            ),
            Failure::Panicked(message) => write!(f, "the evaluation failed: {message}"),
        }
    }
}

impl From<Failure> for EvaluationError {
    fn from(failure: Failure) -> Self {
        EvaluationError(failure.to_string())
    }
}

/// The text a panic carried, when it was a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|message| (*message).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "the interpreter panicked".to_owned())
}

impl fmt::Debug for Expression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.text, f)
    }
}

impl PartialEq for Expression {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Filter,
    Transform,
}

impl Kind {
    fn accepts(self, value: &Value) -> bool {
        match self {
            Kind::Filter => matches!(value, Value::Bool(_)),
            Kind::Transform => matches!(value, Value::Map(_) | Value::List(_)),
        }
    }

    fn must_give(self) -> &'static str {
        match self {
            Kind::Filter => "must give a bool; it",
            Kind::Transform => "must give a map or a list; it",
        }
    }
}

/// A subscription's `filter`: events it gives false for, or fails on, are passed over.
#[derive(Debug, Clone, PartialEq)]
pub struct EventFilter(Expression);

impl EventFilter {
    /// A filter being set, checked.
    pub fn parse(field: &str, text: &str) -> Result<Self> {
        Expression::parse(field, text, Kind::Filter).map(EventFilter)
    }

    /// A filter as stored, which passed [`EventFilter::parse`] then: compiled only, so
    /// reading definitions costs no trial evaluations and a later, stricter check does
    /// not make it unreadable.
    pub fn from_stored(field: &str, text: &str) -> Result<Self> {
        Expression::compile(field, text).map(|(expression, _)| EventFilter(expression))
    }

    pub fn as_str(&self) -> &str {
        &self.0.text
    }

    /// Whether the filter selects the event; an error when it cannot tell, when telling
    /// would cost more than the event's budget, or when the interpreter panicked.
    pub fn matches(&self, event: &Event) -> std::result::Result<bool, EvaluationError> {
        match self.0.evaluate(event)? {
            Value::Bool(selected) => Ok(selected),
            other => Err(EvaluationError(format!(
                "the filter gave {}, not a bool",
                other.type_of()
            ))),
        }
    }
}

/// A subscription's `transform`: its value, as JSON, is the payload delivered.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadTransform(Expression);

impl PayloadTransform {
    /// A transform being set, checked.
    pub fn parse(field: &str, text: &str) -> Result<Self> {
        Expression::parse(field, text, Kind::Transform).map(PayloadTransform)
    }

    /// A transform as stored: see [`EventFilter::from_stored`].
    pub fn from_stored(field: &str, text: &str) -> Result<Self> {
        Expression::compile(field, text).map(|(expression, _)| PayloadTransform(expression))
    }

    pub fn as_str(&self) -> &str {
        &self.0.text
    }

    /// The payload to deliver for the event: the expression's value as JSON, at most
    /// [`DEFAULT_MAX_TRANSFORM_BYTES`] long (see [`PayloadTransform::apply_within`]).
    pub fn apply(&self, event: &Event) -> std::result::Result<Vec<u8>, EvaluationError> {
        self.apply_within(event, DEFAULT_MAX_TRANSFORM_BYTES)
    }

    /// The payload to deliver for the event: the expression's value as JSON, refused
    /// when longer than `max_bytes` (the gateway's `--max-payload-bytes`: no payload it
    /// delivers is larger than one it would accept).
    pub fn apply_within(
        &self,
        event: &Event,
        max_bytes: usize,
    ) -> std::result::Result<Vec<u8>, EvaluationError> {
        let value = self.0.evaluate(event)?;
        if !Kind::Transform.accepts(&value) {
            return Err(EvaluationError(format!(
                "the transform gave {}, not a map or a list",
                value.type_of()
            )));
        }
        let json = value
            .json()
            .map_err(|error| EvaluationError(format!("the transform's value: {error}")))?;
        let payload =
            serde_json::to_vec(&json).map_err(|error| EvaluationError(error.to_string()))?;
        if payload.len() > max_bytes {
            return Err(EvaluationError(format!(
                "the transform's value is {} bytes of JSON; a payload may be at most \
                 {max_bytes} bytes",
                payload.len()
            )));
        }
        Ok(payload)
    }
}

/// What walking an expression found: its size, the identifiers it reads, the names its
/// comprehensions bind.
#[derive(Default)]
struct Shape {
    nodes: usize,
    identifiers: Vec<(u64, String)>,
    bound: BTreeSet<String>,
}

impl Shape {
    /// Walks `expr`; `in_loop`: inside the body of a comprehension, where reading
    /// `payload` or looping again would make the cost grow with the square of the event.
    fn walk(&mut self, expr: &IdedExpr, in_loop: bool) -> std::result::Result<(), (u64, String)> {
        self.nodes += 1;
        if self.nodes > MAX_EXPRESSION_NODES {
            return Ok(());
        }
        match &expr.expr {
            Expr::Unspecified | Expr::Literal(_) => {}
            Expr::Ident(name) => {
                if in_loop && name == "payload" {
                    return Err((
                        expr.id,
                        "`payload` cannot be read inside a comprehension's body (its cost \
                         would grow with the square of the event's size); use the \
                         comprehension's variable"
                            .to_owned(),
                    ));
                }
                self.identifiers.push((expr.id, name.clone()));
            }
            Expr::Call(call) => {
                if let Some(target) = &call.target {
                    self.walk(target, in_loop)?;
                }
                for arg in &call.args {
                    self.walk(arg, in_loop)?;
                }
            }
            Expr::Select(select) => self.walk(&select.operand, in_loop)?,
            Expr::List(list) => {
                for element in &list.elements {
                    self.walk(element, in_loop)?;
                }
            }
            Expr::Map(map) => self.walk_entries(&map.entries, in_loop)?,
            Expr::Struct(structure) => self.walk_entries(&structure.entries, in_loop)?,
            Expr::Comprehension(comprehension) => {
                if in_loop {
                    return Err((
                        expr.id,
                        "comprehensions cannot be nested (their cost would grow with the \
                         square of the event's size)"
                            .to_owned(),
                    ));
                }
                self.walk(&comprehension.iter_range, false)?;
                self.bound.insert(comprehension.iter_var.clone());
                self.bound.extend(comprehension.iter_var2.clone());
                self.bound.insert(comprehension.accu_var.clone());
                self.walk(&comprehension.accu_init, false)?;
                self.walk(&comprehension.loop_cond, true)?;
                self.walk(&comprehension.loop_step, true)?;
                self.walk(&comprehension.result, true)?;
            }
        }
        Ok(())
    }

    fn walk_entries(
        &mut self,
        entries: &[cel::common::ast::IdedEntryExpr],
        in_loop: bool,
    ) -> std::result::Result<(), (u64, String)> {
        for entry in entries {
            match &entry.expr {
                EntryExpr::StructField(field) => self.walk(&field.value, in_loop)?,
                EntryExpr::MapEntry(entry) => {
                    self.walk(&entry.key, in_loop)?;
                    self.walk(&entry.value, in_loop)?;
                }
            }
        }
        Ok(())
    }
}

/// `line:column: ` where the node `id` was written (both counted from 1, the column in
/// characters), as syntax errors are placed.
fn position(program: &Program, id: u64) -> String {
    let info = program.source_info();
    let Some((start, _)) = info.offset_for(id) else {
        return String::new();
    };
    let before = info.source.get(..start as usize).unwrap_or(&info.source);
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .unwrap_or_default()
        .chars()
        .count()
        + 1;
    format!("{line}:{column}: ")
}

/// The first call of the function or reference to the variable `name`.
fn find_call_or_ident(expr: &IdedExpr, name: &str) -> Option<u64> {
    let found = match &expr.expr {
        Expr::Ident(ident) => ident == name,
        Expr::Call(call) => call.func_name == name,
        _ => false,
    };
    if found {
        return Some(expr.id);
    }
    children(expr)
        .into_iter()
        .find_map(|child| find_call_or_ident(child, name))
}

/// The levels of `expr`, itself included.
fn depth(expr: &IdedExpr) -> usize {
    1 + children(expr).into_iter().map(depth).max().unwrap_or(0)
}

/// The nodes directly under `expr`.
fn children(expr: &IdedExpr) -> Vec<&IdedExpr> {
    match &expr.expr {
        Expr::Call(call) => call.target.iter().map(|t| &**t).chain(&call.args).collect(),
        Expr::Select(select) => vec![&select.operand],
        Expr::List(list) => list.elements.iter().collect(),
        Expr::Map(map) => entries_of(&map.entries),
        Expr::Struct(structure) => entries_of(&structure.entries),
        Expr::Comprehension(c) => vec![
            &c.iter_range,
            &c.accu_init,
            &c.loop_cond,
            &c.loop_step,
            &c.result,
        ],
        Expr::Unspecified | Expr::Literal(_) | Expr::Ident(_) => Vec::new(),
    }
}

fn entries_of(entries: &[cel::common::ast::IdedEntryExpr]) -> Vec<&IdedExpr> {
    entries
        .iter()
        .flat_map(|entry| match &entry.expr {
            EntryExpr::StructField(field) => vec![&field.value],
            EntryExpr::MapEntry(entry) => vec![&entry.key, &entry.value],
        })
        .collect()
}

/// A syntax error's refusal: the first of the parser's complaints that a caller can act
/// on (later ones often follow from it), placed, in plain words.
fn syntax_error(errors: &[ParseError]) -> String {
    errors
        .iter()
        .find_map(|error| {
            let reason = plain_syntax_reason(&error.msg)?;
            Some(match error.pos {
                (line, column) if line > 0 && column > 0 => {
                    format!("syntax error at {line}:{column}: {reason}")
                }
                _ => format!("syntax error: {reason}"),
            })
        })
        .unwrap_or_else(|| "syntax error: the expression cannot be parsed".to_owned())
}

/// The parser's message in plain words; `None` for its internal notes ("Incomplete
/// `IndexContext`!"), which only follow another error.
fn plain_syntax_reason(message: &str) -> Option<String> {
    let message = message.strip_prefix("Syntax error: ").unwrap_or(message);
    // A limit the parser stopped at comes wrapped in its error type's debug text.
    if let Some((_, inner)) = message.split_once("msg: \"") {
        let inner = inner.split('"').next().unwrap_or_default();
        return Some(format!("nested too deeply ({})", inner.to_lowercase()));
    }
    if message == "UNKNOWN" || (message.contains('`') && message.ends_with('!')) {
        return None;
    }
    let plain = |text: &str| {
        text.replace("'<EOF>'", "end of the expression")
            .replace("<EOF>", "end of the expression")
    };
    let expecting = |rest: &str| match rest.split_once(" expecting ") {
        Some((found, expected)) => {
            let expected = expected.trim_start_matches('{').trim_end_matches('}');
            let expected = plain(expected);
            match expected.contains(',') {
                true => format!("unexpected {}; expected one of {expected}", plain(found)),
                false => format!("unexpected {}; expected {expected}", plain(found)),
            }
        }
        None => format!("unexpected {}", plain(rest)),
    };
    let reason = if let Some(rest) = message.strip_prefix("mismatched input ") {
        expecting(rest)
    } else if let Some(rest) = message.strip_prefix("extraneous input ") {
        expecting(rest)
    } else if let Some(rest) = message.strip_prefix("token recognition error at: ") {
        format!("unrecognised text {rest}")
    } else if let Some(rest) = message.strip_prefix("no viable alternative at input ") {
        format!("cannot make sense of {}", plain(rest))
    } else if let Some(rest) = message.strip_prefix("missing ") {
        format!("missing {}", plain(rest))
    } else {
        message.to_owned()
    };
    // Control characters the caller typed are shown escaped.
    Some(
        reason
            .chars()
            .flat_map(|c| match c.is_control() {
                true => c.escape_default().collect::<Vec<_>>(),
                false => vec![c],
            })
            .collect(),
    )
}

/// Errors that come from the expression rather than from the event it ran on.
fn is_type_error(error: &ExecutionError) -> bool {
    #[allow(deprecated)]
    let type_error = matches!(
        error,
        ExecutionError::UndeclaredReference(_)
            | ExecutionError::NoSuchOverload(_)
            | ExecutionError::UnsupportedBinaryOperator(..)
            | ExecutionError::UnsupportedUnaryOperator(..)
            | ExecutionError::InvalidArgumentCount { .. }
            | ExecutionError::NotSupportedAsMethod { .. }
            | ExecutionError::MissingArgumentOrTarget
            | ExecutionError::ValuesNotComparable(..)
    );
    type_error
}

/// The value of the variable `name` for `event`.
fn variable(event: &Event, name: &str) -> Value {
    let text = |value: &str| Value::String(Arc::new(value.to_owned()));
    let time = |value: Option<DateTime<Utc>>| {
        value.map_or(Value::Null, |at| Value::Timestamp(at.fixed_offset()))
    };
    match name {
        "id" => text(&event.id.to_string()),
        "event_type" => text(&event.event_type),
        "aggregate_type" => text(&event.aggregate_type),
        "aggregate_id" => text(&event.aggregate_id),
        "aggregate_version" => event.aggregate_version.map_or(Value::Null, Value::Int),
        "source" => text(event.source.as_str()),
        "metadata" => Value::from(event.metadata.clone()),
        "occurred_at" => time(Some(event.occurred_at)),
        "created_at" => time(Some(event.created_at)),
        "deliver_at" => time(event.deliver_at),
        "expires_at" => time(event.expires_at),
        "content_type" => text(&event.content_type),
        "transaction_id" => Value::Int(event.transaction_id),
        "payload" => payload_value(event),
        _ => Value::Null,
    }
}

/// The payload as CEL sees it: JSON values when the content type is JSON and the payload
/// parses, else its bytes.
fn payload_value(event: &Event) -> Value {
    if is_json_content_type(&event.content_type)
        && let Ok(json) = serde_json::from_slice::<serde_json::Value>(&event.payload)
    {
        return json_value(&json);
    }
    Value::Bytes(Arc::new(event.payload.clone()))
}

/// JSON as CEL values: integers stay integers (CEL compares them with doubles).
fn json_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => n
            .as_i64()
            .map(Value::Int)
            .or_else(|| n.as_u64().map(Value::UInt))
            .unwrap_or_else(|| Value::Float(n.as_f64().unwrap_or(f64::NAN))),
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        serde_json::Value::Array(items) => {
            Value::List(Arc::new(items.iter().map(json_value).collect()))
        }
        serde_json::Value::Object(fields) => Value::from(
            fields
                .iter()
                .map(|(key, value)| (key.clone(), json_value(value)))
                .collect::<HashMap<String, Value>>(),
        ),
    }
}

/// An event with every field set, its payload `payload`: what type checks run on.
fn sample_event(payload: &serde_json::Value) -> Event {
    let now = Utc::now();
    Event {
        source: super::SourceName::default_source(),
        id: uuid::Uuid::nil(),
        aggregate_type: "aggregate".into(),
        aggregate_id: "1".into(),
        aggregate_version: Some(1),
        event_type: "event".into(),
        payload: serde_json::to_vec(payload).expect("JSON"),
        content_type: super::DEFAULT_CONTENT_TYPE.into(),
        metadata: Default::default(),
        occurred_at: now,
        created_at: now,
        deliver_at: Some(now),
        expires_at: Some(now),
        transaction_id: 1,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::metering::{MATCHES_LITERAL, METER};
    use super::*;

    fn event(payload: serde_json::Value) -> Event {
        let mut event = sample_event(&payload);
        event.event_type = "order.created".into();
        event.metadata = [("tenant".to_owned(), "acme".to_owned())].into();
        event
    }

    fn filter(text: &str) -> EventFilter {
        EventFilter::parse("subscription.filter", text)
            .unwrap_or_else(|refusal| panic!("{text}: {refusal}"))
    }

    fn refusal(text: &str) -> String {
        match EventFilter::parse("subscription.filter", text) {
            Ok(_) => panic!("{text} was accepted"),
            Err(refusal) => refusal.to_string(),
        }
    }

    #[test]
    fn the_documented_examples_select_what_they_say() {
        let order = event(serde_json::json!({
            "total": 1500, "status": "paid", "previous_status": "new",
            "customer": {"vip": true}, "items": [1, 2, 3, 4]
        }));
        for text in [
            r#"payload.total > 1000.0 && metadata.tenant == "acme""#,
            "payload.status != payload.previous_status",
            "has(payload.customer.vip) && payload.customer.vip",
            r#"event_type.startsWith("order.") && size(payload.items) > 3"#,
        ] {
            assert_eq!(filter(text).matches(&order), Ok(true), "{text}");
        }
        let small = event(
            serde_json::json!({"total": 10, "status": "new", "previous_status": "new",
            "customer": {}, "items": []}),
        );
        assert_eq!(filter("payload.total > 1000.0").matches(&small), Ok(false));
        assert_eq!(
            filter("has(payload.customer.vip) && payload.customer.vip").matches(&small),
            Ok(false)
        );
        assert!(filter("payload.customer.vip").matches(&small).is_err());
    }

    #[test]
    fn non_json_payloads_are_bytes() {
        let mut binary = event(serde_json::json!({}));
        binary.content_type = "application/octet-stream".into();
        binary.payload = vec![1, 2, 3];
        assert_eq!(filter("size(payload) == 3").matches(&binary), Ok(true));
        assert!(filter("payload.total > 1").matches(&binary).is_err());
    }

    #[test]
    fn mistakes_are_refused_with_their_position() {
        assert!(refusal("payload.total >").starts_with("subscription.filter: syntax error at 1:"));
        let unknown = refusal("tenant == \"acme\"");
        assert!(
            unknown.contains("1:1: undeclared reference to \"tenant\""),
            "{unknown}"
        );
        // Past a comprehension's own variable, an unknown name is still found.
        let later = refusal("[1].exists(x, x == 1) || tenant == 'acme'");
        assert!(
            later.contains("1:26: undeclared reference to \"tenant\""),
            "{later}"
        );
        let typed = refusal("event_type > 1");
        assert!(typed.contains("1:12: "), "{typed}");
        assert!(refusal("event_type").contains("must give a bool"));
        assert!(refusal("").contains("is empty"));
        let nested = refusal("payload.items.exists(x, payload.items.exists(y, x == y))");
        assert!(
            nested.contains("1:45: comprehensions cannot be nested"),
            "{nested}"
        );
        let quadratic = refusal("payload.items.exists(x, x == payload.first)");
        assert!(
            quadratic.contains("1:30: `payload` cannot be read"),
            "{quadratic}"
        );
        assert!(
            filter("payload.items.exists(x, x == event_type)")
                .as_str()
                .contains("exists")
        );
        let long = format!("event_type == \"{}\"", "a".repeat(MAX_EXPRESSION_BYTES));
        assert!(refusal(&long).contains("bytes long"));
        let wide = format!("size([{}]) > 0", vec!["1"; 1100].join(","));
        assert!(refusal(&wide).contains("nodes"), "{}", refusal(&wide));
        let chain = format!("size({}) > 0", vec!["event_type"; 60].join(" + "));
        assert!(
            refusal(&chain).contains("is nested 62 levels deep once expanded; at most 50"),
            "{}",
            refusal(&chain)
        );
    }

    #[test]
    fn stored_expressions_are_compiled_without_the_checks_made_when_set() {
        // Refused when set (an unknown name), yet readable once stored: it evaluates, and
        // its error is counted per event.
        let stored = EventFilter::from_stored("filter", "tenant == 'acme'").expect("compiles");
        assert!(stored.matches(&event(serde_json::json!({}))).is_err());
        let read = EventFilter::from_stored("filter", "payload.total > 1").expect("compiles");
        assert_eq!(read, filter("payload.total > 1"));
        assert_eq!(
            read.matches(&event(serde_json::json!({"total": 2}))),
            Ok(true)
        );
        assert!(EventFilter::from_stored("filter", "payload.total >").is_err());
    }

    #[test]
    fn transforms_give_json() {
        let transform = PayloadTransform::parse(
            "subscription.transform",
            r#"{"id": payload.id, "total": payload.total, "type": event_type}"#,
        )
        .expect("transform");
        let body = transform
            .apply(&event(
                serde_json::json!({"id": 7, "total": 9.5, "noise": "x"}),
            ))
            .expect("applied");
        let json: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!({"id": 7, "total": 9.5, "type": "order.created"})
        );
        assert!(transform.apply(&event(serde_json::json!({}))).is_err());
        assert!(PayloadTransform::parse("subscription.transform", "event_type").is_err());
    }

    fn transform(text: &str) -> PayloadTransform {
        PayloadTransform::parse("subscription.transform", text)
            .unwrap_or_else(|refusal| panic!("{text}: {refusal}"))
    }

    #[test]
    fn the_default_transform_cap_is_the_default_payload_limit() {
        assert_eq!(
            DEFAULT_MAX_TRANSFORM_BYTES,
            crate::PublishLimits::default().max_payload_bytes
        );
    }

    #[test]
    fn patterns_the_regex_engine_refuses_are_refused_when_set() {
        let unclosed = refusal(r#"event_type.matches("(a")"#);
        assert!(
            unclosed.starts_with("subscription.filter: 1:")
                && unclosed.contains("\"(a\" is not a valid regular expression: unclosed group"),
            "{unclosed}"
        );
        let huge = refusal(r#"matches(event_type, "\\w{1000}")"#);
        assert!(
            huge.contains("compiles to more than the regular expression engine's limit")
                && huge.contains("(?-u:\\w)"),
            "{huge}"
        );
        let email = refusal(
            r#"metadata.email.matches("^[\\w.+-]{1,64}@[\\w-]{1,63}(\\.[\\w-]{1,63}){1,8}$")"#,
        );
        assert!(email.contains("compiles to more than"), "{email}");
        // The same pattern in ASCII classes is accepted, and works.
        let ascii = filter(
            r#"metadata.tenant.matches("^(?-u:[\\w.+-]){1,64}$") && !event_type.matches("^x")"#,
        );
        assert_eq!(ascii.matches(&event(serde_json::json!({}))), Ok(true));
        // Stored before patterns were checked: readable, and failing per event.
        let stored =
            EventFilter::from_stored("filter", r#"event_type.matches("(a")"#).expect("compiles");
        let error = stored.matches(&event(serde_json::json!({}))).unwrap_err();
        assert!(
            error.0.contains("not a valid regular expression"),
            "{error}"
        );
    }

    #[test]
    fn literal_patterns_are_compiled_once_with_the_expression() {
        let text = r#"event_type.matches("^order\\.") && matches(metadata.tenant, "^ac")"#;
        let compiled = filter(text);
        assert_eq!(compiled.0.patterns.len(), 2);
        assert!(compiled.0.patterns.iter().all(|p| p.regex.is_ok()));
        // What is evaluated calls the compiled patterns, never `matches` itself.
        assert!(find_call_or_ident(&compiled.0.metered, "matches").is_none());
        assert!(find_call_or_ident(&compiled.0.metered, MATCHES_LITERAL).is_some());
        // Shared by every expression holding them: reading a definition again does not
        // compile them again.
        let again = EventFilter::from_stored("filter", text).expect("compiles");
        assert!(Arc::ptr_eq(
            compiled.0.patterns[0].regex.as_ref().unwrap(),
            again.0.patterns[0].regex.as_ref().unwrap()
        ));
        assert_eq!(compiled.matches(&event(serde_json::json!({}))), Ok(true));
        // A pattern read from the event is compiled when evaluated, within its own limit.
        let dynamic = filter("event_type.matches(payload.pattern)");
        assert_eq!(
            dynamic.matches(&event(serde_json::json!({"pattern": "created$"}))),
            Ok(true)
        );
        let too_big = dynamic
            .matches(&event(serde_json::json!({"pattern": "\\w{100}"})))
            .unwrap_err();
        assert!(too_big.0.contains("compiles to more than"), "{too_big}");
        // A type error is still the `matches` overload's.
        assert!(refusal("event_type.matches(1)").contains("matches"));
    }

    #[test]
    fn a_nul_character_is_refused_naming_the_field() {
        assert_eq!(
            refusal("event_type == \"a\0\""),
            "subscription.filter: must not contain the NUL character"
        );
        assert_eq!(
            PayloadTransform::parse("subscription.transform", "{\"a\": 1}\0")
                .unwrap_err()
                .to_string(),
            "subscription.transform: must not contain the NUL character"
        );
    }

    #[test]
    fn syntax_errors_are_told_in_plain_words() {
        assert_eq!(
            refusal("payload.total >"),
            "subscription.filter: syntax error at 1:16: unexpected end of the expression; \
             expected one of '[', '{', '(', '.', '-', '!', 'true', 'false', 'null', \
             NUM_FLOAT, NUM_INT, NUM_UINT, STRING, BYTES, IDENTIFIER"
        );
        // Unoptimised, the parser needs more stack than a test thread has to get there.
        let deep = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(|| refusal(&format!("{}1{}", "(".repeat(100), ")".repeat(100))))
            .expect("thread")
            .join()
            .expect("refused");
        assert!(
            deep.contains(
                "syntax error at 1:97: nested too deeply (recursion limit of 96 exceeded)"
            ),
            "{deep}"
        );
        let index = refusal("payload[");
        assert!(
            !index.contains('`') && index.contains("1:9: unexpected end"),
            "{index}"
        );
        let unknown = refusal("1 = 2");
        assert!(unknown.contains("1:3: unrecognised text '= '"), "{unknown}");
        for text in ["(", "a +* b", "'x", "x.map(1, 2)", "{1:", "a ? b"] {
            let message = refusal(text);
            assert!(
                !message.contains("Error(") && !message.contains('`') && !message.contains('\n'),
                "{text}: {message}"
            );
        }
    }

    #[test]
    fn an_evaluation_over_budget_stops_and_is_an_error() {
        // Each `map` doubles the string: 2^10 times the payload, unless stopped.
        let doubling = format!("[payload.text]{}.size() > 0", ".map(x, x + x)".repeat(10));
        let stored = EventFilter::from_stored("filter", &doubling).expect("compiles");
        let big = event(serde_json::json!({"text": "x".repeat(60_000)}));
        let started = Instant::now();
        let error = stored.matches(&big).unwrap_err();
        assert!(error.0.contains("exceeded its cost budget"), "{error}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // Many literal concatenations, charged though no comprehension loops.
        let concatenated = format!("size({}) > 0", vec!["payload.text"; 20].join(" + "));
        let error = filter(&concatenated).matches(&big).unwrap_err();
        assert!(error.0.contains("exceeded its cost budget"), "{error}");
        // `||` does not hide a spent budget.
        let absorbed = format!("{doubling} || true");
        let error = EventFilter::from_stored("filter", &absorbed)
            .expect("compiles")
            .matches(&big)
            .unwrap_err();
        assert!(error.0.contains("exceeded its cost budget"), "{error}");
        // Linear work over a large event fits its budget.
        let items: Vec<serde_json::Value> = (0..2_000)
            .map(|i| serde_json::json!({"sku": format!("sku-{i}"), "qty": i}))
            .collect();
        let large = event(serde_json::json!({"items": items}));
        assert_eq!(
            filter(r#"payload.items.exists(x, x.sku == "sku-1999") && size(payload.items) > 3"#)
                .matches(&large),
            Ok(true)
        );
        assert_eq!(
            filter(r#"payload.items.filter(x, x.qty % 2 == 0).size() == 1000"#).matches(&large),
            Ok(true)
        );
    }

    #[test]
    fn a_transform_is_bounded_by_its_budget_and_the_payload_limit() {
        // Every item carries all of the metadata: the payload grows with their product.
        let mut wide = event(serde_json::json!({"items": vec![1; 3000]}));
        wide.metadata = (0..16)
            .map(|i| (format!("key-{i}"), "v".repeat(1000)))
            .collect();
        let error = transform("payload.items.map(x, metadata)")
            .apply(&wide)
            .unwrap_err();
        assert!(error.0.contains("exceeded its cost budget"), "{error}");
        let small = event(serde_json::json!({"items": vec![1; 200]}));
        let spread = transform("payload.items.map(x, metadata)");
        assert!(spread.apply(&small).is_ok());
        let error = spread.apply_within(&small, 1000).unwrap_err();
        assert!(
            error
                .0
                .contains("bytes of JSON; a payload may be at most 1000 bytes"),
            "{error}"
        );
    }

    #[test]
    fn a_panic_while_evaluating_is_an_error_and_the_meter_is_reset() {
        let mut broken = filter("event_type == 'order.created'");
        // No expression parses into an unspecified node; the interpreter panics on one.
        broken.0.metered = Arc::new(IdedExpr::default());
        let error = broken.matches(&event(serde_json::json!({}))).unwrap_err();
        assert!(error.0.starts_with("the evaluation failed: "), "{error}");
        assert!(!METER.with(|meter| meter.active.get()));
        assert_eq!(
            filter("event_type == 'order.created'").matches(&event(serde_json::json!({}))),
            Ok(true)
        );
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// Expressions from pieces that read the event, build values, loop and match.
        fn expression() -> impl Strategy<Value = String> {
            let leaf = prop_oneof![
                Just("payload".to_owned()),
                Just("payload.items".to_owned()),
                Just("payload.text".to_owned()),
                Just("payload.n".to_owned()),
                Just("metadata".to_owned()),
                Just("metadata.tenant".to_owned()),
                Just("event_type".to_owned()),
                Just("aggregate_version".to_owned()),
                Just("occurred_at".to_owned()),
                Just("[1, 2, 3]".to_owned()),
                Just("'ab'".to_owned()),
                Just("b'\\x00\\xff'".to_owned()),
                Just("null".to_owned()),
                any::<i64>().prop_map(|n| n.to_string()),
                any::<f64>().prop_map(|n| format!("{n:?}")),
            ];
            leaf.prop_recursive(5, 48, 3, |inner| {
                prop_oneof![
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} + {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} == {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} < {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} / {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} % {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} in {b})")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}[{b}]")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} || {b})")),
                    (inner.clone(), inner.clone(), inner.clone())
                        .prop_map(|(a, b, c)| format!("({a} ? {b} : {c})")),
                    inner.clone().prop_map(|a| format!("size({a})")),
                    inner.clone().prop_map(|a| format!("string({a})")),
                    inner.clone().prop_map(|a| format!("int({a})")),
                    inner.clone().prop_map(|a| format!("-{a}")),
                    inner.clone().prop_map(|a| format!("has({a}.x)")),
                    inner
                        .clone()
                        .prop_map(|a| format!("{a}.matches('^(a|b)*c$')")),
                    (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}.matches({b})")),
                    inner.clone().prop_map(|a| format!("{a}.map(x, x + x)")),
                    inner.clone().prop_map(|a| format!("{a}.map(x, metadata)")),
                    inner.clone().prop_map(|a| format!("{a}.filter(x, x == x)")),
                    inner.clone().prop_map(|a| format!("{a}.exists(x, x > 1)")),
                    inner
                        .clone()
                        .prop_map(|a| format!("{a}.all(x, size(x) > 0)")),
                    inner.clone().prop_map(|a| format!("{a}.exists_one(x, x)")),
                    inner.clone().prop_map(|a| format!("[{a}, {a}, {a}, {a}]")),
                    inner
                        .clone()
                        .prop_map(|a| format!("{{'k': {a}, 'l': {a}}}")),
                    inner.prop_map(|a| format!("optional.of({a}).orValue(1)")),
                ]
            })
        }

        fn payload() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<f64>().prop_map(serde_json::Value::from),
                "[a-c]{0,40}".prop_map(serde_json::Value::from),
                (1usize..20_000).prop_map(|n| serde_json::Value::from("ab".repeat(n))),
            ];
            let value = leaf.prop_recursive(3, 64, 8, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                    prop::collection::btree_map("[a-z]{1,4}", inner, 0..6)
                        .prop_map(|map| { serde_json::Value::Object(map.into_iter().collect()) }),
                ]
            });
            (value.clone(), value.clone(), value, 0usize..2000).prop_map(
                |(text, n, other, items)| {
                    serde_json::json!({
                        "text": text, "n": n, "other": other, "items": vec![7; items]
                    })
                },
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]

            #[test]
            fn evaluation_never_panics_and_stays_within_its_budget(
                text in expression(),
                payload in payload(),
            ) {
                let Ok(filter) = EventFilter::from_stored("filter", &text) else {
                    return Ok(());
                };
                let event = event(payload);
                let budget = budget_for(&event);
                let started = Instant::now();
                let (result, spent) = filter.0.evaluate_metered(&event);
                let elapsed = started.elapsed();
                // Spent past the budget only as the charge that found it spent.
                if spent > budget {
                    prop_assert!(
                        matches!(result, Err(Failure::Exhausted(_))),
                        "{text}: spent {spent} of {budget} yet {result:?}"
                    );
                }
                prop_assert!(
                    !matches!(result, Err(Failure::Panicked(_))),
                    "{text}: {result:?}"
                );
                // Stopped by its deadline at the latest, with room for one operation and
                // a slow test build.
                prop_assert!(
                    elapsed < deadline_for(budget) + Duration::from_millis(500),
                    "{text}: {elapsed:?}"
                );
                // The public entry points give an error, never a panic.
                let _ = filter.matches(&event);
                if let Ok(transform) = PayloadTransform::from_stored("transform", &text) {
                    let _ = transform.apply(&event);
                }
            }
        }
    }
}
