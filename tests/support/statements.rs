//! The SQL statements sqlx logs, collected per test.

use std::sync::{Arc, Mutex};

/// Collects the SQL statements sqlx runs on the current thread while installed.
#[derive(Debug, Clone, Default)]
pub struct StatementLog(Arc<Mutex<Vec<String>>>);

impl StatementLog {
    /// Installs the log as the thread's default subscriber until the guard drops.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::{filter::Targets, layer::SubscriberExt};
        let filter = Targets::new().with_target("sqlx::query", tracing::Level::TRACE);
        let subscriber = tracing_subscriber::registry()
            .with(self.clone())
            .with(filter);
        tracing::subscriber::set_default(subscriber)
    }

    /// Installs the log as the process's subscriber, for drivers that log from threads of
    /// their own (sqlx's SQLite connections run their statements on one thread each). It
    /// stays for the rest of the process: the suite's runner (nextest) gives each test a
    /// process of its own.
    ///
    /// # Panics
    ///
    /// When the process has a subscriber already.
    pub fn install_for_process(&self) {
        use tracing_subscriber::{filter::Targets, layer::SubscriberExt};
        let filter = Targets::new().with_target("sqlx::query", tracing::Level::TRACE);
        let subscriber = tracing_subscriber::registry()
            .with(self.clone())
            .with(filter);
        tracing::subscriber::set_global_default(subscriber)
            .expect("a statement log needs a process of its own (run the suite with nextest)");
    }

    /// Takes the statements logged so far.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().expect("log lock"))
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StatementLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        struct Statement(Option<String>);
        impl tracing::field::Visit for Statement {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                // The full statement when sqlx gives it, else its summary.
                let full = field.name() == "db.statement" && !value.is_empty();
                let summary = field.name() == "summary" && self.0.is_none();
                if full || summary {
                    self.0 = Some(value.trim().to_owned());
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.record_str(field, &format!("{value:?}"));
            }
        }
        let mut statement = Statement(None);
        event.record(&mut statement);
        if let Some(sql) = statement.0 {
            self.0.lock().expect("log lock").push(sql);
        }
    }
}
