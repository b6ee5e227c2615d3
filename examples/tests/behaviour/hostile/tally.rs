//! The checks of each answer against its plan, and the counts the campaign reports.

use super::*;

/// What the campaign saw.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) by_status: BTreeMap<u16, usize>,
    pub(super) by_kind: BTreeMap<String, usize>,
    pub(super) first: BTreeMap<Route, i64>,
    pub(super) replays: usize,
    /// Axum's `text/plain` `Path` rejections seen (see [`Plan::plain_ok`]).
    pub(super) plain: usize,
    /// Non-replayed answers per `(tenant, key)`: what a replay may repeat.
    pub(super) seen: HashMap<KeyScope, Vec<(u16, Vec<u8>)>>,
    pub(super) failures: Vec<String>,
}

impl Tally {
    pub(super) fn fail(&mut self, plan: &Plan, answer: Option<&Answer>, why: String) {
        let got = answer.map_or_else(String::new, |a| {
            format!(
                " (got {} {:?}: {})",
                a.status,
                a.header("content-type"),
                String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
            )
        });
        let what: String = plan.what.chars().take(200).collect();
        self.failures
            .push(format!("{:?} [{what}]: {why}{got}", plan.kind));
    }

    /// Checks one answer; returns the payment it created, if any.
    pub(super) fn check(&mut self, plan: &Plan, answer: &Answer) -> Option<String> {
        let status = answer.status;
        *self.by_status.entry(status).or_default() += 1;
        *self
            .by_kind
            .entry(format!("{:?} {status}", plan.kind))
            .or_default() += 1;
        if !DOCUMENTED.contains(&status) {
            self.fail(
                plan,
                Some(answer),
                format!("{status} is not a documented status"),
            );
        }
        if !plan.expect.contains(&status) {
            self.fail(
                plan,
                Some(answer),
                format!("expected one of {:?}", plan.expect),
            );
        }
        if status >= 400 {
            self.check_problem(plan, answer);
        } else if status < 300 && !plan.head {
            let json = answer
                .header("content-type")
                .is_some_and(|v| v.starts_with("application/json"));
            if !json || serde_json::from_slice::<serde_json::Value>(&answer.body).is_err() {
                self.fail(plan, Some(answer), "a 2xx that is not JSON".into());
            }
        }
        let replayed = answer.replayed();
        if replayed {
            self.replays += 1;
        } else if let Some(scope) = &plan.scope {
            self.seen
                .entry(scope.clone())
                .or_default()
                .push((status, answer.body.clone()));
        }
        if !replayed && plan.kind != Kind::Read {
            let first = matches!(
                (plan.route, status),
                (Route::Payments | Route::Payouts, 201 | 402) | (Route::Refunds, 201)
            );
            if first {
                *self.first.entry(plan.route).or_default() += 1;
            }
        }
        (plan.route == Route::Payments && status == 201)
            .then(|| serde_json::from_slice::<serde_json::Value>(&answer.body).ok())
            .flatten()
            .and_then(|body| body["id"].as_str().map(str::to_owned))
    }

    pub(super) fn check_problem(&mut self, plan: &Plan, answer: &Answer) {
        if plan.plain_ok && answer.header("content-type") == Some("text/plain; charset=utf-8") {
            self.plain += 1;
            return;
        }
        if answer.status == 409 && answer.header("retry-after").is_none() {
            self.fail(plan, Some(answer), "a 409 without Retry-After".into());
        }
        if answer.body.is_empty() && (plan.empty_ok || plan.head) {
            if plan.head && answer.header("content-type") != Some("application/problem+json") {
                self.fail(
                    plan,
                    Some(answer),
                    "a HEAD error that is not a problem".into(),
                );
            }
            return;
        }
        if answer.header("content-type") != Some("application/problem+json") {
            self.fail(
                plan,
                Some(answer),
                "an error that is not application/problem+json".into(),
            );
            return;
        }
        let Ok(problem) = serde_json::from_slice::<serde_json::Value>(&answer.body) else {
            self.fail(plan, Some(answer), "a problem that is not JSON".into());
            return;
        };
        if problem["status"] != answer.status
            || !problem["type"].is_string()
            || !problem["title"].is_string()
            || !problem["detail"].is_string()
        {
            self.fail(
                plan,
                Some(answer),
                "a problem without status, type, title, detail".into(),
            );
        }
        let kind = problem["type"].as_str().unwrap_or_default();
        if answer.status == 503 && kind != example("processor-unavailable") {
            self.fail(
                plan,
                Some(answer),
                "a 503 other than the processor's".into(),
            );
        }
        if let Some(expected) = &plan.problem
            && kind != expected
        {
            self.fail(
                plan,
                Some(answer),
                format!("expected the problem type {expected}"),
            );
        }
        if plan.kind == Kind::NulInJson
            && !problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains("U+0000"))
        {
            self.fail(
                plan,
                Some(answer),
                "the problem does not say what is wrong".into(),
            );
        }
    }

    /// A replay repeats what an earlier request with its key answered.
    pub(super) fn check_replay(&mut self, plan: &Plan, answer: &Answer) {
        if !answer.replayed() {
            return;
        }
        let earlier = plan
            .scope
            .as_ref()
            .and_then(|scope| self.seen.get(scope))
            .is_some_and(|seen| {
                seen.iter()
                    .any(|(status, body)| *status == answer.status && *body == answer.body)
            });
        if !earlier {
            self.fail(
                plan,
                Some(answer),
                "a replay of nothing this key answered".into(),
            );
        }
    }
}
