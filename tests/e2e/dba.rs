//! What a DBA and a secrets store get: a database-only config whose URL is a mounted secret
//! (`${file:…}`), `idem migrate --print`'s script run by hand, and `idem migrate` agreeing
//! that nothing is left to do.

use idem_e2e::{TestEnv, idem_output};

/// A config with only `[database]`, its URL read from a file with a trailing line break and
/// idem's tables in a schema of their own: `idem migrate --print` prints every step, the
/// script runs as printed, after which `--print` has nothing left and `idem migrate` applies
/// nothing new; `idem run` refuses the config for its missing pipelines (exit 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_runs_the_printed_migrations_of_a_database_only_config() {
    let env = TestEnv::new("dba_print").await;
    let secret = std::env::temp_dir().join(format!("{}-url", env.database));
    std::fs::write(&secret, format!("{}\n", env.database_url)).expect("write secret");
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"${{file:{}}}\"\nschema = \"dba\"\n",
            secret.display()
        ),
    )
    .expect("write config");

    let (code, script, stderr) = idem_output(&["migrate", "--print"], &config);
    assert_eq!(code, 0, "{stderr}");
    assert!(script.contains("the steps not applied yet"), "{script}");
    assert!(script.contains("CREATE SCHEMA IF NOT EXISTS"), "{script}");
    assert_eq!(
        env.count("SELECT count(*) FROM pg_namespace WHERE nspname = 'dba'")
            .await,
        0,
        "--print changed nothing"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(script.clone()))
        .execute(&env.pool)
        .await
        .unwrap_or_else(|error| panic!("the printed script: {error}\n{script}"));
    assert_eq!(
        env.count("SELECT count(*) FROM dba.processed_messages")
            .await,
        0
    );

    let (code, again, stderr) = idem_output(&["migrate", "--print"], &config);
    assert_eq!(code, 0, "{stderr}");
    assert!(again.contains("every step is applied already"), "{again}");
    let (code, migrated, stderr) = idem_output(&["migrate"], &config);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        migrated.contains("migrations applied (0 new)"),
        "{migrated}"
    );

    let (code, _, stderr) = idem_output(&["run"], &config);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("no pipelines"), "{stderr}");

    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(secret);
    env.cleanup().await;
}
