//! The web console over HTTP: signing in, sessions, CSRF, roles, every page and action,
//! bad input, and figures that match GetStats and ListDeadLetters exactly.

use std::{net::SocketAddr, time::Duration};

use crate::common::*;
use outbox_gateway::{
    auth::{Role, TokenConfig, token_digest},
    proto::{self, GetStatsRequest, ListDeadLettersRequest},
};
use reqwest::{StatusCode, header};

/// A browser without scripts: one cookie, no redirects followed.
struct Browser {
    client: reqwest::Client,
    base: String,
    cookie: Option<String>,
    /// The Host header to send instead of the address dialled (a DNS name that resolves
    /// to it, as far as the console can tell).
    host: Option<String>,
}

/// A response as the tests look at it.
struct Answer {
    status: StatusCode,
    headers: header::HeaderMap,
    body: String,
}

impl Answer {
    fn location(&self) -> &str {
        self.headers
            .get(header::LOCATION)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
    }

    /// Asserts the status and that the page's text mentions `needle`.
    #[track_caller]
    fn expect(&self, status: StatusCode, needle: &str) -> &Self {
        assert_eq!(self.status, status, "body: {}", self.body);
        let text = self
            .body
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        assert!(
            text.contains(needle),
            "the page does not mention {needle:?}: {}",
            self.body
        );
        self
    }

    /// The exact number of a `<data data-stat=...>` figure.
    fn stat(&self, key: &str) -> u64 {
        let marker = format!("data-stat=\"{key}\" value=\"");
        let start = self
            .body
            .find(&marker)
            .unwrap_or_else(|| panic!("no figure {key} in {}", self.body))
            + marker.len();
        let digits: String = self.body[start..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    }

    /// The value of the first `<data id=...>`.
    fn data(&self, id: &str) -> u64 {
        let marker = format!("id=\"{id}\" value=\"");
        let start = self.body.find(&marker).expect(id) + marker.len();
        self.body[start..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    }

    fn csrf(&self) -> String {
        attribute_after(&self.body, "name=\"csrf\" value=\"").expect("a CSRF field")
    }

    /// Event ids of the listed dead letters, in order.
    fn listed_ids(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let marker = "type=\"checkbox\" name=\"id\" value=\"";
        let mut rest = self.body.as_str();
        while let Some(start) = rest.find(marker) {
            rest = &rest[start + marker.len()..];
            ids.push(rest[..rest.find('"').unwrap()].to_owned());
        }
        ids
    }
}

fn attribute_after(body: &str, marker: &str) -> Option<String> {
    let start = body.find(marker)? + marker.len();
    Some(body[start..start + body[start..].find('"')?].to_owned())
}

impl Browser {
    fn new(address: SocketAddr) -> Browser {
        Browser {
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            base: format!("http://{address}"),
            cookie: None,
            host: None,
        }
    }

    async fn answer(&mut self, request: reqwest::RequestBuilder) -> Answer {
        let request = match &self.cookie {
            Some(cookie) => request.header(header::COOKIE, cookie),
            None => request,
        };
        let request = match &self.host {
            Some(host) => request.header(header::HOST, host),
            None => request,
        };
        let response = request.send().await.expect("the console answers");
        let status = response.status();
        let headers = response.headers().clone();
        if let Some(set) = headers
            .get(header::SET_COOKIE)
            .and_then(|value| value.to_str().ok())
        {
            let pair = set.split(';').next().unwrap().to_owned();
            self.cookie = (!pair.ends_with('=')).then_some(pair);
        }
        Answer {
            status,
            headers,
            body: response.text().await.unwrap(),
        }
    }

    async fn get(&mut self, path: &str) -> Answer {
        let request = self.client.get(format!("{}{path}", self.base));
        self.answer(request).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Answer {
        let request = self.client.post(format!("{}{path}", self.base)).form(form);
        self.answer(request).await
    }

    /// Signs in with the token of `name` (see [`token`]).
    async fn sign_in(&mut self, name: &str) -> Answer {
        let secret = format!("{name}-secret");
        self.post("/sign-in", &[("token", &secret), ("next", "/")])
            .await
    }
}

fn token(name: &str, roles: Vec<Role>) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: token_digest(&format!("{name}-secret")),
        roles,
        event_types: Vec::new(),
        aggregate_types: Vec::new(),
        subscriptions: Vec::new(),
        sources: Vec::new(),
    }
}

fn config_with_tokens(database: &TestDatabase) -> outbox_gateway::Config {
    let mut config = test_config(database.url());
    config.tokens = vec![
        token("operator", vec![Role::Admin]),
        token("watcher", vec![Role::Viewer]),
        token("producer", vec![Role::Publisher]),
    ];
    config
}

/// Publishes `count` events of each type and dead-letters every one of them with the
/// type's error; returns the ids by type.
async fn dead_letters(
    gateway: &TestGateway,
    subscription_name: &str,
    kinds: &[(&str, &str, usize)],
) -> Vec<(String, Vec<String>)> {
    create_subscription(gateway, subscription(subscription_name)).await;
    let mut published = Vec::new();
    let mut total = 0;
    for (index, (event_type, _, count)) in kinds.iter().enumerate() {
        let events = (0..*count)
            .map(|n| event(&format!("a-{index}-{n}"), event_type))
            .collect();
        let ids = publish(gateway, events)
            .await
            .into_iter()
            .map(|result| result.id)
            .collect();
        published.push((event_type.to_string(), ids));
        total += count;
    }
    let mut consumer = Consumer::open(gateway, subscription_name, 100).await;
    for delivery in consumer.take(total, Duration::from_secs(20)).await {
        let event_type = delivery.event.as_ref().unwrap().event_type.clone();
        let (_, reason, _) = kinds
            .iter()
            .find(|(kind, _, _)| *kind == event_type)
            .unwrap();
        nack(
            gateway,
            proto::NackRequest {
                subscription: subscription_name.into(),
                ack_id: delivery.ack_id,
                reason: reason.to_string(),
                dead_letter: true,
                ..Default::default()
            },
        )
        .await;
    }
    published
}

async fn listed_dead_letters(
    gateway: &TestGateway,
    subscription: &str,
    include_resolved: bool,
) -> Vec<proto::DeadLetter> {
    gateway
        .admin()
        .await
        .list_dead_letters(ListDeadLettersRequest {
            subscription: subscription.into(),
            include_resolved,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .dead_letters
}

fn ids_of(letters: &[proto::DeadLetter]) -> Vec<String> {
    letters
        .iter()
        .map(|letter| letter.event.as_ref().unwrap().id.clone())
        .collect()
}

#[tokio::test]
async fn pages_need_a_sign_in_with_a_viewer_or_admin_token() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, config_with_tokens(&database)).await;
    let console = gateway.console.unwrap();
    let mut browser = Browser::new(console);

    // Pages send a stranger to sign in, and back afterwards.
    let page = browser.get("/subscriptions/orders?event_type=a").await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert_eq!(
        page.location(),
        "/sign-in?next=%2Fsubscriptions%2Forders%3Fevent_type%3Da"
    );
    let sign_in = browser.get(page.location()).await;
    sign_in.expect(StatusCode::OK, "name=\"token\"");
    for policy in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(
            sign_in.headers[header::CONTENT_SECURITY_POLICY]
                .to_str()
                .unwrap()
                .contains(policy)
        );
    }
    assert!(!sign_in.body.contains("<script>"), "no inline script");
    assert!(!sign_in.body.contains("style="), "no inline style");

    // Unknown tokens, tokens without a console role and no token are refused.
    browser
        .post("/sign-in", &[("token", "guess")])
        .await
        .expect(StatusCode::UNAUTHORIZED, "not known");
    browser
        .sign_in("producer")
        .await
        .expect(StatusCode::FORBIDDEN, "viewer or admin role");
    browser
        .post("/sign-in", &[("token", "")])
        .await
        .expect(StatusCode::BAD_REQUEST, "token");
    assert!(browser.cookie.is_none(), "no session for refused sign-ins");

    // A viewer signs in with a strict, HttpOnly cookie and sees the overview.
    let signed_in = browser
        .post(
            "/sign-in",
            &[("token", "watcher-secret"), ("next", "/events")],
        )
        .await;
    assert_eq!(signed_in.status, StatusCode::SEE_OTHER);
    assert_eq!(signed_in.location(), "/events");
    let cookie = signed_in.headers[header::SET_COOKIE].to_str().unwrap();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    browser
        .get("/")
        .await
        .expect(StatusCode::OK, "No subscriptions yet")
        .expect(StatusCode::OK, "watcher · viewer");

    // Signing out ends the session for good.
    let overview = browser.get("/").await;
    let csrf = overview.csrf();
    let old_cookie = browser.cookie.clone();
    browser
        .post("/sign-out", &[("csrf", "forged")])
        .await
        .expect(StatusCode::FORBIDDEN, "Form expired");
    let out = browser.post("/sign-out", &[("csrf", &csrf)]).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(browser.cookie.is_none(), "the cookie is cleared");
    browser.cookie = old_cookie;
    let page = browser.get("/").await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert!(
        page.location().starts_with("/sign-in"),
        "{}",
        page.location()
    );
}

/// Whether a Location header is a path on the console itself, percent-encoded: visible
/// ASCII only, one leading slash, no backslash.
fn is_encoded_local_path(location: &str) -> bool {
    location.starts_with('/')
        && !location.starts_with("//")
        && location
            .bytes()
            .all(|byte| byte.is_ascii_graphic() && byte != b'\\')
}

#[tokio::test]
async fn signing_in_returns_only_to_a_path_of_this_console() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, config_with_tokens(&database)).await;
    let console = gateway.console.unwrap();

    // A tab (or any control character) in `next` is refused before the token is even
    // looked at: no session, and no redirect a browser would read as another host's.
    let mut stranger = Browser::new(console);
    stranger
        .get("/sign-in?next=/%09/evil.example/")
        .await
        .expect(StatusCode::BAD_REQUEST, "next");
    for control in ["\t", "\r", "\n", "\0", "\x7f", "\x01", "\x1b"] {
        let next = format!("/{control}/evil.example/");
        let refused = stranger
            .post("/sign-in", &[("token", "operator-secret"), ("next", &next)])
            .await;
        refused.expect(
            StatusCode::BAD_REQUEST,
            "next: must not contain control characters",
        );
        assert!(
            !refused.headers.contains_key(header::SET_COOKIE),
            "{control:?}: no session for a refused sign-in"
        );
        assert!(stranger.cookie.is_none(), "{control:?}");
    }
    // Plain HTTP: no HSTS, which would pin the name to a TLS the console does not speak.
    let page = stranger.get("/sign-in").await;
    page.expect(StatusCode::OK, "name=\"token\"");
    assert!(!page.headers.contains_key(header::STRICT_TRANSPORT_SECURITY));

    // Anything but a path of this console that reads the same once parsed goes to the
    // overview, before and after signing in.
    let foreign = [
        "//evil.example/",
        "/\\evil.example/",
        "https://evil.example/",
        "/..//evil.example/",
        "/./%2e/..//evil.example/",
        "/ /evil.example",
        "/subscriptions/ordérs",
        "/events?q=\"<x>\"",
        "evil.example",
    ];
    for next in foreign {
        let signed_in = Browser::new(console)
            .post("/sign-in", &[("token", "operator-secret"), ("next", next)])
            .await;
        assert_eq!(signed_in.status, StatusCode::SEE_OTHER, "{next:?}");
        assert_eq!(signed_in.location(), "/", "{next:?}");
    }
    let mut operator = Browser::new(console);
    operator.sign_in("operator").await;
    for next in foreign {
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("next", next)
            .finish();
        let answer = operator.get(&format!("/sign-in?{query}")).await;
        assert_eq!(answer.status, StatusCode::SEE_OTHER, "{next:?}");
        assert_eq!(answer.location(), "/", "{next:?}");
    }
    operator
        .get("/sign-in?next=/%09/evil.example/")
        .await
        .expect(StatusCode::BAD_REQUEST, "next");

    // The console's own paths come back as they were.
    for next in [
        "/subscriptions/orders?event_type=order.paid&error=card%20declined",
        "/events/0190b5e5-0000-7000-8000-000000000000?source=billing",
        "/",
    ] {
        let signed_in = Browser::new(console)
            .post("/sign-in", &[("token", "operator-secret"), ("next", next)])
            .await;
        assert_eq!(signed_in.location(), next);
        assert!(is_encoded_local_path(signed_in.location()));
    }
}

#[tokio::test]
async fn without_tokens_sign_in_links_return_only_to_this_console() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    let console = gateway.console.unwrap();

    let mut browser = Browser::new(console);
    let refused = browser.get("/sign-in?next=/%09/evil.example/").await;
    refused.expect(StatusCode::BAD_REQUEST, "next");
    let refused = browser
        .post("/sign-in", &[("next", "/\r\nSet-Cookie: x=1")])
        .await;
    refused.expect(StatusCode::BAD_REQUEST, "next");
    assert!(browser.cookie.is_none(), "no session for a refused request");

    for (next, location) in [
        ("//evil.example/", "/"),
        ("/..//evil.example/", "/"),
        ("/subscriptions/ordérs", "/"),
        ("/events?id=1", "/events?id=1"),
    ] {
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("next", next)
            .finish();
        let answer = browser.get(&format!("/sign-in?{query}")).await;
        assert_eq!(answer.status, StatusCode::SEE_OTHER, "{next:?}");
        assert_eq!(answer.location(), location, "{next:?}");
    }
}

#[tokio::test]
async fn without_tokens_the_console_answers_only_loopback_names_and_addresses() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    create_subscription(&gateway, subscription("orders")).await;
    let console = gateway.console.unwrap();
    let port = console.port();

    // A page from a name that a rebinding DNS server pointed at 127.0.0.1 gets no
    // session, no page and no action.
    for host in [
        format!("rebind.example:{port}"),
        "rebind.example".to_owned(),
        format!("localhost.evil.example:{port}"),
        format!("127.0.0.1.evil.example:{port}"),
    ] {
        let mut browser = Browser::new(console);
        browser.host = Some(host.clone());
        let refused = browser.get("/").await;
        refused.expect(StatusCode::MISDIRECTED_REQUEST, "--console-allowed-hosts");
        assert!(
            !refused.headers.contains_key(header::SET_COOKIE),
            "{host}: no session"
        );
        assert!(browser.cookie.is_none(), "{host}");
    }
    let mut local = Browser::new(console);
    let csrf = local.get("/subscriptions/orders").await.csrf();
    let mut rebound = Browser::new(console);
    rebound.cookie = local.cookie.clone();
    rebound.host = Some(format!("rebind.example:{port}"));
    let pause = rebound
        .client
        .post(format!("{}/subscriptions/orders/pause", rebound.base))
        .header(header::ORIGIN, format!("http://rebind.example:{port}"))
        .form(&[("csrf", csrf.as_str()), ("reason", "rebound")]);
    rebound
        .answer(pause)
        .await
        .expect(StatusCode::MISDIRECTED_REQUEST, "rebind.example");
    let orders = gateway
        .admin()
        .await
        .get_subscription(proto::GetSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!orders.paused, "nothing changed: {orders:?}");

    // Loopback names and literal addresses are served.
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LOCALHOST".to_owned(),
        format!("console.localhost:{port}"),
        format!("[::1]:{port}"),
        "10.1.2.3".to_owned(),
        format!("[fd00::1]:{port}"),
    ] {
        let mut browser = Browser::new(console);
        browser.host = Some(host.clone());
        browser.get("/").await.expect(StatusCode::OK, "Overview");
        assert!(browser.cookie.is_some(), "{host}: a session");
    }

    // Names the operator lists are served too, and only those.
    let mut config = test_config(database.url());
    config.console_allowed_hosts = outbox_gateway::domain::AllowedHosts::parse(&[
        "console.internal".to_owned(),
        "*.ops.example.com".to_owned(),
    ])
    .unwrap();
    let listed = TestGateway::start_with_console(&database, config).await;
    let console = listed.console.unwrap();
    for (host, status) in [
        ("console.internal:9465", StatusCode::OK),
        ("gw-1.ops.example.com", StatusCode::OK),
        ("127.0.0.1", StatusCode::OK),
        ("rebind.example", StatusCode::MISDIRECTED_REQUEST),
    ] {
        let mut browser = Browser::new(console);
        browser.host = Some(host.to_owned());
        assert_eq!(browser.get("/").await.status, status, "{host}");
    }
}

/// Sends `head` (request line and headers, without the blank line) to `console` and
/// returns the status line of the answer.
async fn raw_status_line(console: SocketAddr, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(console)
        .await
        .expect("connect to the console");
    stream
        .write_all(format!("{head}Connection: close\r\n\r\n").as_bytes())
        .await
        .expect("send the request");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_string(&mut answer))
        .await
        .expect("the console answers in time")
        .expect("read the answer");
    answer.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_request_with_two_host_headers_is_refused_as_bad() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    let console = gateway.console.unwrap();
    let port = console.port();
    let allowed = format!("Host: 127.0.0.1:{port}\r\n");
    assert_eq!(
        raw_status_line(console, &format!("GET / HTTP/1.1\r\n{allowed}")).await,
        "HTTP/1.1 200 OK",
        "one allowed Host is served"
    );
    // Whichever comes first, and even when both are allowed: RFC 9112 says 400.
    for second in ["Host: rebind.example\r\n", allowed.as_str()] {
        for head in [
            format!("GET / HTTP/1.1\r\n{allowed}{second}"),
            format!("GET / HTTP/1.1\r\n{second}{allowed}"),
        ] {
            assert_eq!(
                raw_status_line(console, &head).await,
                "HTTP/1.1 400 Bad Request",
                "{head:?}"
            );
        }
    }
}

#[tokio::test]
async fn with_tokens_any_host_name_is_sent_to_sign_in() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, config_with_tokens(&database)).await;
    let mut browser = Browser::new(gateway.console.unwrap());
    browser.host = Some("gateway.example.com".to_owned());
    let page = browser.get("/").await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert_eq!(page.location(), "/sign-in?next=%2F");
    browser.sign_in("operator").await;
    browser.get("/").await.expect(StatusCode::OK, "Overview");
}

#[tokio::test]
async fn viewers_cannot_act_and_forged_or_foreign_forms_change_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, config_with_tokens(&database)).await;
    // Producers and consumers use a gateway of their own on the same database.
    let setup = TestGateway::start(&database).await;
    let published = dead_letters(&setup, "orders", &[("order.paid", "card declined", 3)]).await;
    let ids = &published[0].1;
    let pool = database.pool().await;
    let before = delivery_records(&pool, "orders").await;
    let console = gateway.console.unwrap();
    let requeue_path = format!("/events/{}/requeue", ids[0]);

    // No session: refused, not redirected.
    let mut stranger = Browser::new(console);
    stranger
        .post(
            "/subscriptions/orders/dead-letters",
            &[("action", "requeue-matching"), ("confirm", "1")],
        )
        .await
        .expect(StatusCode::UNAUTHORIZED, "Sign in");

    // A viewer sees the dead letters but neither the actions nor the right to use them.
    let mut viewer = Browser::new(console);
    viewer.sign_in("watcher").await;
    let page = viewer.get("/subscriptions/orders").await;
    page.expect(StatusCode::OK, "card declined");
    assert!(!page.body.contains("Requeue all"), "no actions for viewers");
    let csrf = page.csrf();
    for (path, form) in [
        (
            "/subscriptions/orders/dead-letters",
            vec![("action", "requeue-matching"), ("confirm", "1")],
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![
                ("action", "resolve-selected"),
                ("id", ids[0].as_str()),
                ("confirm", "1"),
            ],
        ),
        (
            "/subscriptions/orders/seek",
            vec![("to", "latest"), ("confirm", "1")],
        ),
        (requeue_path.as_str(), vec![("subscription", "orders")]),
    ] {
        let mut form = form.clone();
        form.push(("csrf", &csrf));
        viewer
            .post(path, &form)
            .await
            .expect(StatusCode::FORBIDDEN, "the admin role");
    }

    // An admin's forms without the session's token, or from another site, are refused.
    let mut admin = Browser::new(console);
    admin.sign_in("operator").await;
    let csrf = admin.get("/subscriptions/orders").await.csrf();
    fn requeue_all(csrf: &str) -> [(&str, &str); 3] {
        [
            ("action", "requeue-matching"),
            ("confirm", "1"),
            ("csrf", csrf),
        ]
    }
    for forged in ["", "0000"] {
        admin
            .post("/subscriptions/orders/dead-letters", &requeue_all(forged))
            .await
            .expect(StatusCode::FORBIDDEN, "Form expired");
    }
    let foreign = admin
        .client
        .post(format!("{}/subscriptions/orders/dead-letters", admin.base))
        .header(header::ORIGIN, "http://evil.example")
        .form(&requeue_all(&csrf));
    admin
        .answer(foreign)
        .await
        .expect(StatusCode::FORBIDDEN, "Form expired");
    // The viewer's token is not the admin's.
    let viewer_csrf = viewer.get("/").await.csrf();
    admin
        .post(
            "/subscriptions/orders/dead-letters",
            &requeue_all(&viewer_csrf),
        )
        .await
        .expect(StatusCode::FORBIDDEN, "Form expired");

    assert_eq!(
        delivery_records(&pool, "orders").await,
        before,
        "nothing changed"
    );
    assert_eq!(listed_dead_letters(&setup, "orders", false).await.len(), 3);

    // With the right token the admin's action goes through.
    let form = requeue_all(&csrf);
    let done = admin
        .post("/subscriptions/orders/dead-letters", &form)
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    admin
        .get(done.location())
        .await
        .expect(StatusCode::OK, "Requeued 3 dead letters of orders.");
    assert!(
        listed_dead_letters(&setup, "orders", false)
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn an_expired_session_must_sign_in_again_and_its_forms_change_nothing() {
    let database = TestDatabase::create().await;
    let mut config = config_with_tokens(&database);
    // Long enough that signing in and reading a form fit in it on a loaded machine.
    const SESSION_TTL: Duration = Duration::from_secs(5);
    config.console_session_ttl = SESSION_TTL;
    let gateway = TestGateway::start_with_console(&database, config).await;
    let setup = TestGateway::start(&database).await;
    dead_letters(&setup, "orders", &[("order.paid", "card declined", 2)]).await;
    let pool = database.pool().await;
    let before = delivery_records(&pool, "orders").await;

    let mut admin = Browser::new(gateway.console.unwrap());
    admin.sign_in("operator").await;
    let csrf = admin.get("/subscriptions/orders").await.csrf();
    let mut page = admin.get("/").await;
    let within = Duration::from_secs(20);
    let deadline = std::time::Instant::now() + within;
    while page.status == StatusCode::OK {
        assert!(
            std::time::Instant::now() < deadline,
            "the session outlived its {SESSION_TTL:?}"
        );
        tokio::time::sleep(POLL).await;
        page = admin.get("/").await;
    }
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert_eq!(page.location(), "/sign-in?next=%2F&ended=1");
    admin
        .get(page.location())
        .await
        .expect(StatusCode::OK, "Your session has ended");
    admin
        .post(
            "/subscriptions/orders/dead-letters",
            &[
                ("action", "requeue-matching"),
                ("confirm", "1"),
                ("csrf", &csrf),
            ],
        )
        .await
        .expect(StatusCode::UNAUTHORIZED, "Your session has ended");
    assert_eq!(
        delivery_records(&pool, "orders").await,
        before,
        "nothing changed"
    );
}

#[tokio::test]
async fn figures_and_dead_letters_match_get_stats_and_list_dead_letters_exactly() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.console_rate_interval = Duration::from_millis(200);
    let gateway = TestGateway::start_with_console(&database, config).await;
    let published = dead_letters(
        &gateway,
        "orders",
        &[
            ("order.paid", "card declined", 3),
            ("order.shipped", "address unknown", 2),
        ],
    )
    .await;
    // A second subscription with one delivery in flight and backlog behind it.
    create_subscription(&gateway, subscription("billing")).await;
    let mut billing = Consumer::open(&gateway, "billing", 1).await;
    let in_flight = billing
        .next(Duration::from_secs(10))
        .await
        .expect("a delivery");
    let mut browser = Browser::new(gateway.console.unwrap());

    // Without tokens the console serves on loopback to anyone, as gRPC does.
    let overview = browser.get("/").await;
    overview.expect(StatusCode::OK, "anonymous");
    for name in ["orders", "billing"] {
        let expected = subscription_stats(&gateway, name).await;
        let page = browser.get("/").await;
        for (stat, value) in [
            ("pending", expected.pending),
            ("in_flight", expected.in_flight),
            ("awaiting_retry", expected.awaiting_retry),
            ("dead_lettered", expected.dead_lettered),
            ("lag_events", expected.lag_events),
        ] {
            assert_eq!(
                page.stat(&format!("{name}.{stat}")),
                value,
                "{name}.{stat} on the overview"
            );
        }
        let page = browser.get(&format!("/subscriptions/{name}")).await;
        for (stat, value) in [
            ("pending", expected.pending),
            ("in_flight", expected.in_flight),
            ("dead_lettered", expected.dead_lettered),
            ("delivered_total", expected.delivered_total),
            ("acked_total", expected.acked_total),
        ] {
            assert_eq!(page.stat(&format!("{name}.{stat}")), value, "{name}.{stat}");
        }
    }
    assert_eq!(overview.stat("orders.dead_lettered"), 5);
    assert_eq!(overview.stat("billing.in_flight"), 1);
    assert_eq!(overview.stat("outbox.events_stored"), 5);

    // The listing is ListDeadLetters', page by page; the groups count by error.
    let page = browser.get("/subscriptions/orders?page_size=2").await;
    page.expect(StatusCode::OK, "Dead letters by error");
    let all = ids_of(&listed_dead_letters(&gateway, "orders", false).await);
    assert_eq!(page.listed_ids(), all[..2]);
    assert_eq!(page.data("matching"), 5);
    assert!(page.body.contains("card declined") && page.body.contains("address unknown"));
    let next = attribute_after(
        &page.body,
        "href=\"/subscriptions/orders?page_size=2&amp;page=",
    )
    .expect("a next page");
    let token = next.split('#').next().unwrap().replace("&amp;", "&");
    let second = browser
        .get(&format!("/subscriptions/orders?page_size=2&page={token}"))
        .await;
    assert_eq!(second.listed_ids(), all[2..4]);

    // Filters by type, aggregate and error count and list exactly what they match.
    let paid = &published[0].1;
    let page = browser
        .get("/subscriptions/orders?event_type=order.paid")
        .await;
    assert_eq!(page.data("matching"), 3);
    let mut listed = page.listed_ids();
    listed.sort();
    let mut expected = paid.clone();
    expected.sort();
    assert_eq!(listed, expected);
    let page = browser
        .get("/subscriptions/orders?aggregate_type=order&aggregate_id=a-1-0")
        .await;
    assert_eq!(page.listed_ids(), [published[1].1[0].clone()]);
    let page = browser
        .get("/subscriptions/orders?error=address+unknown")
        .await;
    assert_eq!(page.data("matching"), 2);
    let page = browser
        .get("/subscriptions/orders?after=2000-01-01T00:00&before=2000-01-02T00:00:00Z")
        .await;
    assert_eq!(page.data("matching"), 0);
    page.expect(StatusCode::OK, "No dead letters match this filter.");

    // Requeue by filter: the count first, then, once confirmed, exactly those.
    let csrf = page.csrf();
    let form = [
        ("csrf", csrf.as_str()),
        ("action", "requeue-matching"),
        ("event_type", "order.paid"),
    ];
    let preview = browser
        .post("/subscriptions/orders/dead-letters", &form)
        .await;
    preview.expect(StatusCode::OK, "Requeue 3 dead letters?");
    assert_eq!(preview.data("confirm-count"), 3);
    assert_eq!(
        listed_dead_letters(&gateway, "orders", false).await.len(),
        5,
        "a preview changes nothing"
    );
    let mut confirmed = form.to_vec();
    confirmed.push(("confirm", "1"));
    let done = browser
        .post("/subscriptions/orders/dead-letters", &confirmed)
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    assert_eq!(
        done.location(),
        "/subscriptions/orders?event_type=order.paid#dead-letters"
    );
    browser
        .get(done.location())
        .await
        .expect(StatusCode::OK, "Requeued 3 dead letters of orders.");
    let remaining = listed_dead_letters(&gateway, "orders", false).await;
    let mut shipped = published[1].1.clone();
    shipped.sort();
    let mut remaining_ids = ids_of(&remaining);
    remaining_ids.sort();
    assert_eq!(remaining_ids, shipped);

    // Resolve one by id with a note.
    let resolved_id = published[1].1[0].clone();
    let form = [
        ("csrf", csrf.as_str()),
        ("action", "resolve-selected"),
        ("id", resolved_id.as_str()),
        ("notes", "refunded by hand"),
    ];
    browser
        .post("/subscriptions/orders/dead-letters", &form)
        .await
        .expect(StatusCode::OK, "Resolve 1 dead letter?")
        .expect(StatusCode::OK, "refunded by hand");
    let mut confirmed = form.to_vec();
    confirmed.push(("confirm", "1"));
    assert_eq!(
        browser
            .post("/subscriptions/orders/dead-letters", &confirmed)
            .await
            .status,
        StatusCode::SEE_OTHER
    );
    let letters = listed_dead_letters(&gateway, "orders", true).await;
    let resolved = letters
        .iter()
        .find(|letter| letter.event.as_ref().unwrap().id == resolved_id)
        .unwrap();
    assert!(resolved.resolved);
    assert_eq!(
        (resolved.resolved_by.as_str(), resolved.notes.as_str()),
        ("anonymous", "refunded by hand")
    );
    let page = browser
        .get("/subscriptions/orders?include_resolved=on")
        .await;
    page.expect(StatusCode::OK, "Resolved by anonymous");
    assert_eq!(page.data("matching"), 2);

    // The event page: payload, metadata and each subscription's state, with requeue.
    let event_id = published[1].1[1].clone();
    let page = browser.get(&format!("/events/{event_id}")).await;
    page.expect(StatusCode::OK, "\"aggregate\": \"a-1-1\"");
    assert!(page.body.contains("data-state=\"dead\""), "{}", page.body);
    assert!(page.body.contains("address unknown"));
    assert!(
        page.body.contains("data-state=\"pending\"")
            || page.body.contains("data-state=\"in flight\"")
    );
    let done = browser
        .post(
            &format!("/events/{event_id}/requeue"),
            &[("csrf", &csrf), ("subscription", "orders")],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    browser
        .get(done.location())
        .await
        .expect(StatusCode::OK, "Requeued event")
        .expect(StatusCode::OK, "data-state=\"awaiting retry\"");
    browser
        .get("/events?aggregate_type=order&aggregate_id=a-1-1")
        .await
        .expect(StatusCode::OK, &event_id);
    let found = browser.get(&format!("/events?id={event_id}")).await;
    assert_eq!(found.location(), format!("/events/{event_id}"));

    // Seek to the latest: confirmed first, then billing's backlog is skipped.
    assert!(subscription_stats(&gateway, "billing").await.pending > 0);
    let form = [("csrf", csrf.as_str()), ("to", "latest")];
    browser
        .post("/subscriptions/billing/seek", &form)
        .await
        .expect(StatusCode::OK, "Every event not yet handed out is skipped");
    assert!(
        subscription_stats(&gateway, "billing").await.pending > 0,
        "a preview changes nothing"
    );
    let mut confirmed = form.to_vec();
    confirmed.push(("confirm", "1"));
    assert_eq!(
        browser
            .post("/subscriptions/billing/seek", &confirmed)
            .await
            .status,
        StatusCode::SEE_OTHER
    );
    assert_eq!(subscription_stats(&gateway, "billing").await.pending, 0);

    // Rates: deliveries and acks counted between two samples show on the overview.
    ack_all(&gateway, "billing", vec![in_flight.ack_id]).await;
    publish(
        &gateway,
        vec![event("b-1", "order.created"), event("b-2", "order.created")],
    )
    .await;
    for _ in 0..2 {
        let delivery = billing
            .next(Duration::from_secs(20))
            .await
            .expect("a delivery");
        ack_all(&gateway, "billing", vec![delivery.ack_id]).await;
    }
    eventually(
        "the overview shows billing's rates",
        Duration::from_secs(20),
        || {
            let mut browser = Browser::new(gateway.console.unwrap());
            async move {
                let page = browser.get("/").await;
                let Some(start) = page.body.find("data-subscription=\"billing\"") else {
                    return false;
                };
                let row = &page.body[start..];
                let row = &row[..row.find("</tr>").unwrap_or(row.len())];
                row.contains("aria-label=\"deliveries ")
                    && !row.contains("deliveries 0/s")
                    && !row.contains("acks 0/s")
            }
        },
    )
    .await;
}

async fn cursors(pool: &sqlx::PgPool) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT cursor_xact_id, cursor_position FROM outbox_cursors ORDER BY subscription_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn bad_input_gets_a_clear_message_and_changes_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    let published = dead_letters(&gateway, "orders", &[("order.paid", "card declined", 2)]).await;
    let id = published[0].1[0].clone();
    let requeue_path = format!("/events/{id}/requeue");
    let pool = database.pool().await;
    let before = delivery_records(&pool, "orders").await;
    let cursor_before = cursors(&pool).await;
    let mut browser = Browser::new(gateway.console.unwrap());

    for (path, status, needle) in [
        (
            "/subscriptions/orders?event_type=order..paid",
            StatusCode::BAD_REQUEST,
            "event_type",
        ),
        (
            "/subscriptions/orders?after=yesterday",
            StatusCode::BAD_REQUEST,
            "after: \"yesterday\" is not a time",
        ),
        (
            "/subscriptions/orders?before=2025-13-40T00:00",
            StatusCode::BAD_REQUEST,
            "before",
        ),
        (
            "/subscriptions/orders?after=2025-01-02T00:00:00Z&before=2025-01-01T00:00:00Z",
            StatusCode::BAD_REQUEST,
            "after: must be earlier than before",
        ),
        (
            "/subscriptions/orders?after=2025-01-02T00:00&tz=east",
            StatusCode::BAD_REQUEST,
            "tz",
        ),
        (
            "/subscriptions/orders?aggregate_id=a%00b",
            StatusCode::BAD_REQUEST,
            "aggregate_id",
        ),
        (
            "/subscriptions/orders?page_size=0",
            StatusCode::BAD_REQUEST,
            "page_size",
        ),
        (
            "/subscriptions/orders?page=nonsense",
            StatusCode::BAD_REQUEST,
            "page",
        ),
        (
            "/subscriptions/orders?include_resolved=maybe",
            StatusCode::BAD_REQUEST,
            "include_resolved",
        ),
        (
            "/subscriptions/Not%20A%20Name",
            StatusCode::BAD_REQUEST,
            "subscription",
        ),
        (
            "/subscriptions/missing",
            StatusCode::NOT_FOUND,
            "subscription \"missing\" does not exist",
        ),
        (
            "/events/nope",
            StatusCode::BAD_REQUEST,
            "id: \"nope\" is not an event id",
        ),
        ("/events?id=zz", StatusCode::BAD_REQUEST, "id"),
        (
            "/events/0192F1C4-0000-7000-8000-000000000000",
            StatusCode::BAD_REQUEST,
            "canonical",
        ),
        (
            "/events?id=%7B0192f1c4-0000-7000-8000-000000000000%7D",
            StatusCode::BAD_REQUEST,
            "canonical",
        ),
        (
            "/events?aggregate_type=order",
            StatusCode::BAD_REQUEST,
            "aggregate_id: is required",
        ),
        (
            "/events/0192f1c4-0000-7000-8000-000000000000",
            StatusCode::NOT_FOUND,
            "does not exist",
        ),
        ("/no/such/page", StatusCode::NOT_FOUND, "no such page"),
        ("/assets/secret.txt", StatusCode::NOT_FOUND, "no such page"),
    ] {
        browser.get(path).await.expect(status, needle);
    }

    let csrf = browser.get("/subscriptions/orders").await.csrf();
    let long_note = "n".repeat(5000);
    for (path, form, status, needle) in [
        (
            "/subscriptions/orders/dead-letters",
            vec![("action", "shred")],
            StatusCode::BAD_REQUEST,
            "action",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![],
            StatusCode::BAD_REQUEST,
            "action",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![("action", "requeue-selected"), ("confirm", "1")],
            StatusCode::BAD_REQUEST,
            "id: select at least one dead letter",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![
                ("action", "requeue-selected"),
                ("id", "nope"),
                ("confirm", "1"),
            ],
            StatusCode::BAD_REQUEST,
            "id: \"nope\"",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![
                ("action", "requeue-matching"),
                ("event_type", "order..x"),
                ("confirm", "1"),
            ],
            StatusCode::BAD_REQUEST,
            "event_type",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![("action", "requeue-matching"), ("confirm", "yes please")],
            StatusCode::BAD_REQUEST,
            "confirm",
        ),
        (
            "/subscriptions/orders/dead-letters",
            vec![
                ("action", "resolve-matching"),
                ("notes", long_note.as_str()),
                ("confirm", "1"),
            ],
            StatusCode::BAD_REQUEST,
            "notes: must be at most 4096 bytes",
        ),
        (
            "/subscriptions/missing/dead-letters",
            vec![("action", "requeue-matching"), ("confirm", "1")],
            StatusCode::NOT_FOUND,
            "does not exist",
        ),
        (
            "/subscriptions/orders/seek",
            vec![("to", "soon"), ("confirm", "1")],
            StatusCode::BAD_REQUEST,
            "to: \"soon\"",
        ),
        (
            "/subscriptions/orders/seek",
            vec![("to", "time"), ("confirm", "1")],
            StatusCode::BAD_REQUEST,
            "time: is required",
        ),
        (
            "/subscriptions/orders/seek",
            vec![("to", "time"), ("time", "noon"), ("confirm", "1")],
            StatusCode::BAD_REQUEST,
            "time",
        ),
        (
            "/subscriptions/missing/seek",
            vec![("to", "latest"), ("confirm", "1")],
            StatusCode::NOT_FOUND,
            "does not exist",
        ),
        (
            requeue_path.as_str(),
            vec![("subscription", "missing")],
            StatusCode::NOT_FOUND,
            "does not exist",
        ),
        (
            requeue_path.as_str(),
            vec![("subscription", "Bad Name")],
            StatusCode::BAD_REQUEST,
            "subscription",
        ),
        (
            "/events/nope/requeue",
            vec![],
            StatusCode::BAD_REQUEST,
            "id",
        ),
    ] {
        let mut form = form.clone();
        form.push(("csrf", &csrf));
        browser
            .post(path, &form)
            .await
            .expect(status, needle)
            .expect(status, "Nothing was changed");
    }
    assert_eq!(
        delivery_records(&pool, "orders").await,
        before,
        "no record changed"
    );
    assert_eq!(cursors(&pool).await, cursor_before, "no cursor moved");
}

#[tokio::test]
async fn a_lost_database_is_an_error_page_and_the_console_recovers() {
    let database = TestDatabase::create().await;
    let proxy = proxy::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let gateway = TestGateway::start_with_console(
        &database,
        test_config(proxy.database_url(database.name())),
    )
    .await;
    let mut browser = Browser::new(gateway.console.unwrap());
    browser.get("/").await.expect(StatusCode::OK, "Overview");
    proxy.cut();
    browser
        .get("/")
        .await
        .expect(StatusCode::SERVICE_UNAVAILABLE, "Database unreachable");
    proxy.restore();
    eventually("the overview is back", Duration::from_secs(20), || {
        let mut browser = Browser::new(gateway.console.unwrap());
        async move { browser.get("/").await.status == StatusCode::OK }
    })
    .await;
}

#[tokio::test]
async fn under_tls_the_console_speaks_only_tls_and_its_cookie_is_secure() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::{
        TlsConnector,
        rustls::{ClientConfig, RootCertStore, crypto::ring, pki_types::ServerName},
    };

    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let certificate = CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "outbox-console-tls-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cert.pem"), certificate.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    let database = TestDatabase::create().await;
    let mut config = config_with_tokens(&database);
    config.tls = Some(outbox_gateway::config::TlsFiles {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        client_ca: None,
    });
    config
        .validate()
        .expect("a configuration serve would accept");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let console_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let console = console_listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(outbox_gateway::run_with_console(
        config,
        listener,
        Some(console_listener),
        async {
            let _ = stopped.await;
        },
    ));

    // Plain HTTP gets no page.
    let plain = reqwest::Client::new()
        .get(format!("http://{console}/sign-in"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());

    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let client = ClientConfig::builder_with_provider(ring::default_provider().into())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = TlsConnector::from(std::sync::Arc::new(client));
    let body = "token=operator-secret&next=%2F";
    let request = format!(
        "POST /sign-in HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = poll_until(Duration::from_secs(20), POLL, || {
        let connector = connector.clone();
        let request = request.clone();
        async move {
            let stream = tokio::net::TcpStream::connect(console).await.ok()?;
            let mut stream = connector
                .connect(ServerName::try_from("localhost").unwrap(), stream)
                .await
                .ok()?;
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.ok()?;
            Some(answer)
        }
    })
    .await
    .expect("the console answers over TLS");
    assert!(answer.starts_with("HTTP/1.1 303"), "{answer}");
    let cookie = answer
        .lines()
        .find(|line| line.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("a session cookie");
    for attribute in ["Secure", "HttpOnly", "SameSite=Strict"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    // Browsers that saw the console over TLS never try it in plain HTTP again.
    let hsts = answer
        .lines()
        .find(|line| {
            line.to_ascii_lowercase()
                .starts_with("strict-transport-security:")
        })
        .expect("HSTS under TLS");
    assert!(hsts.contains("max-age=31536000"), "{hsts}");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_subscription_page_shows_its_pause_schedule_and_expiry() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_event_age: seconds(600),
            dead_letter_expired: true,
            ..subscription("reminders")
        },
    )
    .await;
    gateway
        .admin()
        .await
        .pause_subscription(proto::PauseSubscriptionRequest {
            name: "reminders".into(),
            reason: "downstream outage".into(),
            until: None,
        })
        .await
        .expect("pause");
    let in_an_hour =
        prost_types::Timestamp::from(std::time::SystemTime::now() + Duration::from_secs(3600));
    publish(
        &gateway,
        vec![proto::EventInput {
            deliver_at: Some(in_an_hour),
            ..event("r-1", "reminder.due")
        }],
    )
    .await;

    let mut browser = Browser::new(gateway.console.unwrap());
    let page = browser.get("/subscriptions/reminders").await;
    page.expect(StatusCode::OK, "downstream outage")
        .expect(StatusCode::OK, "events older than 10 min")
        .expect(StatusCode::OK, "expired events are dead-lettered");
    assert_eq!(page.stat("reminders.scheduled"), 1);
    assert_eq!(page.stat("reminders.expired_total"), 0);

    // An admin resumes and pauses from the page; a forged form changes nothing.
    async fn reminders(gateway: &TestGateway) -> proto::Subscription {
        gateway
            .admin()
            .await
            .get_subscription(proto::GetSubscriptionRequest {
                name: "reminders".into(),
            })
            .await
            .unwrap()
            .into_inner()
    }
    let csrf = page.csrf();
    let resumed = browser
        .post("/subscriptions/reminders/resume", &[("csrf", &csrf)])
        .await;
    assert_eq!(resumed.status, StatusCode::SEE_OTHER);
    assert!(!reminders(&gateway).await.paused);
    browser
        .get(resumed.location())
        .await
        .expect(StatusCode::OK, "Resumed reminders")
        .expect(StatusCode::OK, "action=\"/subscriptions/reminders/pause\"");
    let forged = browser
        .post(
            "/subscriptions/reminders/pause",
            &[("csrf", "forged"), ("reason", "nope")],
        )
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    assert!(!reminders(&gateway).await.paused);
    let done = browser
        .post(
            "/subscriptions/reminders/pause",
            &[("csrf", &csrf), ("reason", "data fix")],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    let now = reminders(&gateway).await;
    assert!(now.paused && now.pause_reason == "data fix", "{now:?}");
}

#[tokio::test]
async fn a_subscription_page_says_whether_it_pushes_and_where() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.push.allowed_hosts =
        outbox_gateway::domain::AllowedHosts::parse(&["127.0.0.1".to_owned()]).unwrap();
    let gateway = TestGateway::start_with_console(&database, config).await;
    create_subscription(&gateway, subscription("pulled")).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            push: Some(proto::PushConfig {
                endpoint: "http://127.0.0.1:9/hook".into(),
                ..Default::default()
            }),
            ..subscription("pushed")
        },
    )
    .await;
    let mut browser = Browser::new(gateway.console.unwrap());
    browser
        .get("/subscriptions/pulled")
        .await
        .expect(StatusCode::OK, "pull (Subscribe streams)");
    browser.get("/subscriptions/pushed").await.expect(
        StatusCode::OK,
        "push to <code>http://127.0.0.1:9/hook</code>, binary CloudEvents, 16 in flight",
    );
}

#[tokio::test]
async fn one_subscription_whose_figures_fail_leaves_the_shared_views_standing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start_with_console(&database, test_config(database.url())).await;
    create_subscription(&gateway, subscription("healthy")).await;
    create_subscription(&gateway, subscription("broken")).await;
    // Patterns stored before they were bounded: PostgreSQL refuses the regular
    // expression they make as too complex, so every query of this subscription fails.
    let patterns: Vec<String> = (0..5000)
        .map(|i| format!("t{i:04}{}", "x".repeat(245)))
        .collect();
    sqlx::query("UPDATE outbox_subscriptions SET event_types = $1 WHERE name = 'broken'")
        .bind(&patterns)
        .execute(&database.pool().await)
        .await
        .unwrap();
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    let all = gateway
        .admin()
        .await
        .get_stats(GetStatsRequest::default())
        .await
        .expect("GetStats of every subscription answers")
        .into_inner();
    let row = |name: &str| {
        all.subscriptions
            .iter()
            .find(|stats| stats.name == name)
            .unwrap_or_else(|| panic!("{name} in {all:?}"))
    };
    assert_eq!(row("healthy").error, "");
    assert_eq!(row("healthy").pending, 1);
    assert!(
        row("broken").error.contains("could not be computed"),
        "{:?}",
        row("broken")
    );
    let mut browser = Browser::new(gateway.console.unwrap());
    let page = browser.get("/").await;
    page.expect(StatusCode::OK, "could not be computed");
}
