//! What the service knows of PostgreSQL's error codes (SQLSTATEs), in one
//! place: which say the connection is gone, which say "try again later",
//! and which give away a connection pooler that moves prepared statements
//! between sessions.

/// Errors that say the connection (not the statement) failed: it was closed
/// or broken, or the server is shutting down, crashed or starting. Other
/// connections may be in the same state.
pub(crate) fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            matches!(code.as_ref(), "57P01" | "57P02" | "57P03") || code.starts_with("08")
        }),
        _ => false,
    }
}

/// The server is starting up (57P03, "the database system is starting up"):
/// worth waiting for at start.
pub(crate) fn starting(code: &str) -> bool {
    code == "57P03"
}

/// Whether a database error with this SQLSTATE says "try again later". Logs,
/// once per process, what to set when the code gives away a pooler in
/// transaction mode.
pub(crate) fn transient(code: &str, message: &str) -> bool {
    if code == "XX000" && citus_lost_a_node(message) {
        return true;
    }
    if pooled_in_transaction_mode(code) {
        warn_of_transaction_pooling(message);
        return true;
    }
    transient_class(code)
}

/// Citus reports a worker it lost mid-transaction as internal_error (XX000),
/// where its other connection failures are 08006: "could not commit
/// transaction for shard … on at least one active node" and "server closed
/// the connection unexpectedly" (while executing a command on a worker).
/// Whether the transaction committed is then unknown, as with a COMMIT
/// whose answer was lost: "try again" (a retried Claim or Complete finds its
/// own lease token), not a bug.
fn citus_lost_a_node(message: &str) -> bool {
    [
        "could not commit transaction",
        "server closed the connection unexpectedly",
        "connection to the remote node",
        "failed to commit transaction",
        "could not establish any connections to the node",
    ]
    .iter()
    .any(|text| message.contains(text))
}

/// SQLSTATEs a session never sees for its own prepared statements, unless
/// something hands its statements to other sessions: 42P05 (a prepared
/// statement of that name already exists) and 26000 (it does not exist). That
/// is a connection pooler in transaction mode (PgBouncer's `pool_mode =
/// transaction` before 1.21), which gives each transaction whatever server
/// connection is free.
fn pooled_in_transaction_mode(code: &str) -> bool {
    matches!(code, "42P05" | "26000")
}

/// Says, once per process, what to set: the calls answer UNAVAILABLE and
/// health NOT_SERVING until the pooler is configured for the service.
fn warn_of_transaction_pooling(message: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::error!(
            postgres_message = message,
            "PostgreSQL reports a prepared statement of this session missing or \
             duplicated: the service reaches the database through a connection \
             pooler in transaction mode (PgBouncer pool_mode = transaction), which \
             moves prepared statements between clients. Set pool_mode = session \
             for the service's database (PgBouncer 1.21 or later also works in \
             transaction mode with max_prepared_statements > 0), or connect to \
             PostgreSQL directly; see docs/operations.md, \"Behind PgBouncer\""
        );
    });
}

/// SQLSTATE classes that say "try again": 08 (connection), 53 (insufficient
/// resources), 57P (shutting down or starting), 58 (system), 40
/// (serialization failure, deadlock); and 25006 (a read-only transaction):
/// the service reached a standby, as during a failover when a router sends
/// connections to the new primary a moment before it leaves recovery.
fn transient_class(code: &str) -> bool {
    code == "25006"
        || ["08", "53", "57P", "58", "40"]
            .iter()
            .any(|class| code.starts_with(class))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_and_lock_errors_are_transient() {
        assert!(transient_class("08006"));
        assert!(pooled_in_transaction_mode("42P05"));
        assert!(pooled_in_transaction_mode("26000"));
        assert!(!pooled_in_transaction_mode("42P01"));
        assert!(transient_class("57P01"));
        assert!(!transient_class("23505"));
        assert!(transient_class("25006"));
        assert!(transient(
            "XX000",
            "could not commit transaction for shard 102013 on at least one active node"
        ));
        assert!(transient(
            "XX000",
            "server closed the connection unexpectedly"
        ));
        assert!(!transient("XX000", "cache lookup failed for relation 1234"));
        assert!(starting("57P03"));
    }
}
