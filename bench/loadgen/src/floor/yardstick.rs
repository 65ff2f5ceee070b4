//! The database floor's two statements, taken from the yardstick's own text
//! (bench/handwritten/claim-complete.sql, the script pgbench runs against the
//! service in bench/compare.sh), so that the floor runs exactly what the
//! hand-written side runs and there is one home for that SQL.
//!
//! The script is a pgbench script: comments, `\set` lines, the claiming
//! upsert ending in `\gset`, then the guarded UPDATE. Its pgbench variables
//! become numbered parameters, in the order the floor binds them.

/// The pgbench script, compiled into the binary.
const SCRIPT: &str = include_str!("../../../handwritten/claim-complete.sql");

/// The two statements of one Claim+Complete cycle.
#[derive(Debug)]
pub struct Statements {
    /// The claiming upsert: `$1` namespace, `$2` key; returns `fencing`
    /// (bigint) and `lease_token` (uuid), or no row when the key is held or
    /// completed.
    pub claim: String,
    /// The guarded UPDATE: `$1` response, `$2` namespace, `$3` key, `$4`
    /// lease token; one row when the lease was still held.
    pub complete: String,
}

impl Statements {
    /// The statements of bench/handwritten/claim-complete.sql.
    pub fn from_script() -> Result<Self, String> {
        parse(SCRIPT)
    }
}

/// Splits the script into its upsert and its UPDATE and numbers their
/// variables; fails when the script no longer has that shape, or a
/// variable is left that the floor does not bind.
fn parse(script: &str) -> Result<Statements, String> {
    let sql: Vec<&str> = script
        .lines()
        .map(str::trim_end)
        .filter(|line| !line.trim_start().starts_with("--") && !line.starts_with("\\set"))
        .collect();
    let sql = sql.join("\n");
    let (claim, complete) = sql
        .split_once("\\gset")
        .ok_or("the script has no \\gset ending its upsert")?;
    // Longest names first, so that `:k` does not eat into a longer name.
    let claim = number(claim, &[(":ns", "$1"), (":k", "$2")])?;
    let complete = number(
        complete,
        &[
            (":lease_token", "$4"),
            (":resp", "$1"),
            (":ns", "$2"),
            (":k", "$3"),
        ],
    )?;
    if !claim.starts_with("INSERT") || !complete.starts_with("UPDATE") {
        return Err(format!(
            "expected an INSERT then an UPDATE, found {:?} and {:?}",
            first_word(&claim),
            first_word(&complete)
        ));
    }
    Ok(Statements { claim, complete })
}

fn number(statement: &str, variables: &[(&str, &str)]) -> Result<String, String> {
    let mut text = statement.trim().trim_end_matches(';').trim().to_owned();
    for (variable, parameter) in variables {
        text = text.replace(variable, parameter);
    }
    // A `:name` left over is a variable this floor would not bind (a `::`
    // cast is not one).
    let bytes = text.as_bytes();
    for (i, pair) in bytes.windows(2).enumerate() {
        let before = if i == 0 { b' ' } else { bytes[i - 1] };
        if pair[0] == b':' && pair[1].is_ascii_alphabetic() && before != b':' {
            return Err(format!("an unbound variable in {text:?}"));
        }
    }
    Ok(text)
}

fn first_word(text: &str) -> &str {
    text.split_whitespace().next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_yardstick_script_gives_an_upsert_and_a_guarded_update() {
        let statements = Statements::from_script().unwrap();
        assert!(
            statements
                .claim
                .starts_with("INSERT INTO idempotency_keys AS t")
        );
        assert!(
            statements
                .claim
                .contains("VALUES ($1, $2, 1, NULL, gen_random_uuid()")
        );
        assert!(statements.claim.ends_with("RETURNING fencing, lease_token"));
        assert!(statements.complete.starts_with("UPDATE idempotency_keys"));
        assert!(
            statements
                .complete
                .contains("SET state = 2, response = $1,")
        );
        assert!(
            statements
                .complete
                .ends_with("WHERE namespace = $2 AND key = $3 AND lease_token = $4 AND state = 1")
        );
    }

    #[test]
    fn a_variable_the_floor_does_not_bind_is_refused() {
        let script = "INSERT INTO t VALUES (:ns, :k, :other) RETURNING x \\gset\nUPDATE t SET a = :resp WHERE b = :ns AND c = :k AND d = :lease_token;";
        assert!(parse(script).unwrap_err().contains("unbound variable"));
    }

    #[test]
    fn a_script_without_gset_is_refused() {
        assert!(parse("INSERT INTO t VALUES (:ns, :k);").is_err());
    }
}
