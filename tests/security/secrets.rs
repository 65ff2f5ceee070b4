//! Secrets: no database password in logs, errors or `--help`, and the token
//! command's token and the hash a policy holds.

use std::process::Stdio;

use idempotency_service::access::hash_token;
use tempfile::TempDir;

use crate::common::pki;
use crate::common::process;

#[tokio::test]
async fn no_database_password_reaches_logs_help_or_errors() {
    let dir = TempDir::new().unwrap();
    let secret = "s3cr3t-Pa55word";
    let url = format!(
        "postgres://app:{secret}@127.0.0.1:{}/db",
        process::free_port()
    );
    let url_file = pki::write(dir.path(), "database-url", &format!("{url}\n"));

    let run = |configure: &dyn Fn(&mut std::process::Command)| {
        let mut command = process::command(dir.path());
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        command.env("IDEMPOTENCY_DB_TIMEOUT", "1s");
        configure(&mut command);
        let output = command.output().unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr),
        )
    };
    type Configure<'a> = &'a dyn Fn(&mut std::process::Command);
    let cases: [(&str, Configure); 4] = [
        ("serve with DATABASE_URL", &|c| {
            c.env("DATABASE_URL", &url);
        }),
        ("serve with DATABASE_URL_FILE", &|c| {
            c.env("DATABASE_URL_FILE", &url_file);
        }),
        ("migrate", &|c| {
            c.env("DATABASE_URL", &url).arg("migrate");
        }),
        ("--help", &|c| {
            c.env("DATABASE_URL", &url).arg("--help");
        }),
    ];
    for (what, configure) in cases {
        let (status, output) = run(configure);
        assert!(
            !output.contains(secret),
            "{what} printed the password:\n{output}"
        );
        if what == "--help" {
            assert!(status.success());
            assert!(output.contains("DATABASE_URL_FILE"), "{output}");
        } else {
            assert!(
                !status.success(),
                "{what} should fail: nothing listens there"
            );
            assert!(!output.is_empty(), "{what} should say why it failed");
        }
    }
}

#[tokio::test]
async fn the_token_command_prints_a_token_and_the_hash_the_policy_holds() {
    let dir = TempDir::new().unwrap();
    let output = process::command(dir.path())
        .arg("token")
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    let mut lines = text.lines();
    let token = lines
        .next()
        .unwrap()
        .strip_prefix("token:  ")
        .unwrap()
        .to_owned();
    let policy_line = lines.next().unwrap();
    assert_eq!(
        policy_line,
        format!("policy: token_hashes = [\"{}\"]", hash_token(&token))
    );
    assert!(token.starts_with("idem_") && token.len() == 69, "{token}");

    let mut child = process::command(dir.path())
        .args(["token", "--hash"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{token}\n").as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        format!("{}\n", hash_token(&token))
    );
}
