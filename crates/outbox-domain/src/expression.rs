//! CEL expressions over events: a subscription's `filter` (which events it receives) and
//! `transform` (what payload they carry). Parsing, the checks made when one is set, and
//! evaluation against one event.
//!
//! Cost is bounded before an expression is stored: its length, its size in nodes, and
//! comprehensions (`all`, `exists`, `map`, `filter`…) whose bodies may not read
//! `payload` nor loop again. The work of one evaluation is then linear in the size of the
//! event, whatever the expression, so no event can make a claim slow.
//!
//! CEL has no static types here (the crate interprets), so a type error is found by
//! evaluating the expression against sample events that differ only in the shape of
//! their payload: it is refused when it fails with a type error on every one of them.

use std::{
    collections::{BTreeSet, HashMap},
    fmt,
    sync::Arc,
};

use cel::{
    Context, Env, ExecutionError, Program, Value,
    common::ast::{EntryExpr, Expr, IdedExpr},
};
use chrono::{DateTime, Utc};

use super::{
    event::{Event, is_json_content_type},
    refusal::{Refusal, Result},
};

/// Longest expression, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 4096;
/// Most nodes of an expression once its macros are expanded.
const MAX_EXPRESSION_NODES: usize = 1000;

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
    /// The standard environment, built once per thread: building it is far costlier than
    /// an evaluation.
    static ENV: Arc<Env> = Arc::new(Env::stdlib());
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
    program: Arc<Program>,
    /// The variables it reads, found once: evaluations bind only these.
    variables: Vec<&'static str>,
}

impl Expression {
    /// Parses an expression being set, with every check: size, names, types.
    fn parse(field: &str, text: &str, kind: Kind) -> Result<Self> {
        if text.trim().is_empty() {
            return Err(Refusal::invalid(field, "is empty"));
        }
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
        expression.check_types(field, kind)?;
        Ok(expression)
    }

    /// Compiles `text` and walks it: what the checks of [`Expression::parse`] look at,
    /// and all an expression stored after them needs.
    fn compile(field: &str, text: &str) -> Result<(Self, Shape)> {
        let program = ENV.with(|env| env.compile(text)).map_err(|errors| {
            let reasons: Vec<String> = errors
                .errors
                .iter()
                .map(|error| format!("{}:{}: {}", error.pos.0, error.pos.1, error.msg))
                .collect();
            Refusal::invalid(field, format!("syntax error at {}", reasons.join("; ")))
        })?;
        let mut shape = Shape::default();
        shape
            .walk(program.expression(), false)
            .map_err(|(id, reason)| {
                Refusal::invalid(field, format!("{}{reason}", position(&program, id)))
            })?;
        let expression = Expression {
            text: text.to_owned(),
            variables: EXPRESSION_VARIABLES
                .into_iter()
                .filter(|variable| shape.identifiers.iter().any(|(_, name)| name == variable))
                .collect(),
            program: Arc::new(program),
        };
        Ok((expression, shape))
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
                Err(error) if !is_type_error(&error) => return Ok(()),
                Err(error) => format!("{}{error}", self.position_of(&error)),
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

    fn evaluate(&self, event: &Event) -> std::result::Result<Value, ExecutionError> {
        ENV.with(|env| {
            let mut context = Context::with_env(Arc::clone(env));
            for &name in &self.variables {
                context.add_variable_from_value(name, variable(event, name));
            }
            self.program.execute(&context)
        })
    }
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

    /// Whether the filter selects the event; an error when it cannot tell.
    pub fn matches(&self, event: &Event) -> std::result::Result<bool, EvaluationError> {
        match self.0.evaluate(event) {
            Ok(Value::Bool(selected)) => Ok(selected),
            Ok(other) => Err(EvaluationError(format!(
                "the filter gave {}, not a bool",
                other.type_of()
            ))),
            Err(error) => Err(EvaluationError(error.to_string())),
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

    /// The payload to deliver for the event: the expression's value as JSON.
    pub fn apply(&self, event: &Event) -> std::result::Result<Vec<u8>, EvaluationError> {
        let value = self
            .0
            .evaluate(event)
            .map_err(|error| EvaluationError(error.to_string()))?;
        if !Kind::Transform.accepts(&value) {
            return Err(EvaluationError(format!(
                "the transform gave {}, not a map or a list",
                value.type_of()
            )));
        }
        let json = value
            .json()
            .map_err(|error| EvaluationError(format!("the transform's value: {error}")))?;
        serde_json::to_vec(&json).map_err(|error| EvaluationError(error.to_string()))
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
    let children: Vec<&IdedExpr> = match &expr.expr {
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
    };
    children
        .into_iter()
        .find_map(|child| find_call_or_ident(child, name))
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
}
