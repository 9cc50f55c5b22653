//! `idem dlq`: a pipeline's dead letters, looked at, and replayed, discarded or archived by
//! selection.

use std::path::Path;

use idem_host::config::{Config, PipelineConfig};
use idem_host::source;
use idem_host::source::dead_letters::{Action, PREVIEW_CHARS, Selection, cut_line};
use idem_host::store::database;
use idem_host::store::tables::Tables;
use idem_host::triage::{self, ArchiveTo};

use crate::exit::{Exit, UsageError};
use crate::lookup::ConfigArg;
use crate::lookup::pipeline_named;
use crate::output::{FormatArg, print_json};
use crate::table::{format_age, print_table, printable};

/// Dead letters: list, show, and replay, discard or archive by error kind, reason, age or id.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: DlqArgs,
}

impl Args {
    /// The report's format, for the commands that have one.
    pub fn format(&self) -> Option<FormatArg> {
        match &self.command {
            DlqArgs::List(args) => Some(args.format),
            DlqArgs::Show(args) => Some(args.format),
            DlqArgs::Replay(args) => Some(args.format),
            DlqArgs::Discard(args) => Some(args.format),
            DlqArgs::Archive(_) => None,
        }
    }

    pub async fn run(self) -> anyhow::Result<Exit> {
        match self.command {
            DlqArgs::List(args) => args.run().await,
            DlqArgs::Show(args) => args.run().await,
            DlqArgs::Replay(args) => args.run().await,
            DlqArgs::Discard(args) => args.run().await,
            DlqArgs::Archive(args) => args.run().await,
        }
    }
}

/// The pipeline whose dead-letter queue a `dlq` command reads.
#[derive(clap::Args)]
struct DlqTarget {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long, short)]
    pipeline: String,
}

/// Which dead letters a `dlq` command acts on; all given filters must match.
#[derive(clap::Args)]
struct DlqFilter {
    /// The error kind, e.g. invalid-input, plugin-trap, retries-exhausted, sql.
    #[arg(long)]
    kind: Option<String>,
    /// A fragment of the reason.
    #[arg(long)]
    reason: Option<String>,
    /// Dead-lettered at most this long ago, e.g. 30m or 2h.
    #[arg(long, value_parser = idem_host::config::parse_duration)]
    since: Option<std::time::Duration>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<u64>,
    /// Only the dead letter with this id (as `idem dlq list --json` and the console show
    /// them); repeat for several.
    #[arg(long = "id")]
    ids: Vec<String>,
}

impl DlqFilter {
    fn selection(self) -> Selection {
        Selection {
            kind: self.kind,
            reason: self.reason,
            since: self.since,
            ids: (!self.ids.is_empty()).then(|| self.ids.into_iter().collect()),
            limit: self.limit,
        }
    }
}

#[derive(clap::Subcommand)]
enum DlqArgs {
    List(ListArgs),
    Show(ShowArgs),
    Replay(ReplayArgs),
    Discard(DiscardArgs),
    Archive(ArchiveArgs),
}

/// List dead letters, oldest first: number, age, error kind, reason, body preview. Every
/// message is looked at and returned in its order; nothing is consumed.
#[derive(clap::Args)]
struct ListArgs {
    #[command(flatten)]
    target: DlqTarget,
    #[command(flatten)]
    filter: DlqFilter,
    #[command(flatten)]
    format: FormatArg,
}

impl ListArgs {
    async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.target.config.config)?;
        let pipeline = pipeline_named(&config, &self.target.pipeline)?;
        list(pipeline, &self.filter.selection(), self.format.is_json()).await
    }
}

/// Show one dead letter in full: headers, properties and body.
#[derive(clap::Args)]
struct ShowArgs {
    #[command(flatten)]
    target: DlqTarget,
    /// Its number in `idem dlq list`.
    number: u64,
    #[command(flatten)]
    format: FormatArg,
}

impl ShowArgs {
    async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.target.config.config)?;
        let pipeline = pipeline_named(&config, &self.target.pipeline)?;
        show(pipeline, self.number, self.format.is_json()).await
    }
}

/// Move the matching dead letters to the pipeline's queue (original headers kept, plus
/// x-idem-replays); the others stay where they are.
#[derive(clap::Args)]
struct ReplayArgs {
    #[command(flatten)]
    target: DlqTarget,
    #[command(flatten)]
    filter: DlqFilter,
    /// Show what would move; move nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    format: FormatArg,
}

impl ReplayArgs {
    async fn run(self) -> anyhow::Result<Exit> {
        let selection = self.filter.selection();
        replay_from(
            &self.target.config.config,
            &self.target.pipeline,
            selection,
            self.dry_run,
            self.format,
        )
        .await
    }
}

/// Remove the matching dead letters for good (they will never be replayed). Without a
/// filter, --all is required.
#[derive(clap::Args)]
struct DiscardArgs {
    #[command(flatten)]
    target: DlqTarget,
    #[command(flatten)]
    filter: DlqFilter,
    /// Every dead letter of the pipeline.
    #[arg(long)]
    all: bool,
    /// Show what would go; remove nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    format: FormatArg,
}

impl DiscardArgs {
    async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.target.config.config)?;
        let pipeline = pipeline_named(&config, &self.target.pipeline)?;
        discard(pipeline, self.filter, self.all, self.dry_run, self.format).await
    }
}

/// Keep the matching dead letters in the database's idem_dead_letters table (or --to a
/// JSON-lines file), then remove them from the dead-letter queue or stream.
#[derive(clap::Args)]
struct ArchiveArgs {
    #[command(flatten)]
    target: DlqTarget,
    #[command(flatten)]
    filter: DlqFilter,
    /// Append them to this file as JSON lines instead of the table.
    #[arg(long)]
    to: Option<std::path::PathBuf>,
    /// Show what would go; write and remove nothing.
    #[arg(long)]
    dry_run: bool,
}

impl ArchiveArgs {
    async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.target.config.config)?;
        let pipeline = pipeline_named(&config, &self.target.pipeline)?;
        let selection = self.filter.selection();
        archive(
            &config,
            pipeline,
            &selection,
            self.to.as_deref(),
            self.dry_run,
        )
        .await
    }
}

/// Replays the dead letters `selection` takes of pipeline `pipeline_name` in the config at
/// `path` (`idem dlq replay`, `idem replay`).
pub async fn replay_from(
    path: &Path,
    pipeline_name: &str,
    selection: Selection,
    dry_run: bool,
    format: FormatArg,
) -> anyhow::Result<Exit> {
    let config = Config::load(path)?;
    let pipeline = pipeline_named(&config, pipeline_name)?;
    replay(pipeline, &selection, dry_run, format).await
}

async fn list(
    pipeline: &PipelineConfig,
    selection: &Selection,
    as_json: bool,
) -> anyhow::Result<Exit> {
    let mut rows = Vec::new();
    let mut letters = Vec::new();
    source::pass_dead_letters(pipeline, selection, Action::Look, |letter| {
        if as_json {
            letters.push(letter.json(false));
        } else {
            rows.push([
                letter.position.to_string(),
                letter.age.map_or("-".into(), format_age),
                letter.kind.clone().unwrap_or_else(|| "-".into()),
                cut_line(letter.reason.as_deref().unwrap_or("-"), 80),
                cut_line(
                    &String::from_utf8_lossy(&letter.message.body),
                    PREVIEW_CHARS,
                ),
            ]);
        }
    })
    .await?;
    if as_json {
        print_json(&serde_json::Value::from(letters))?;
        return Ok(Exit::Success);
    }
    let count = rows.len();
    print_table(&["#", "AGE", "KIND", "REASON", "BODY"], rows);
    eprintln!(
        "{count} dead letter(s) in {:?} match; nothing was moved",
        pipeline.dead_letter()
    );
    Ok(Exit::Success)
}

async fn show(pipeline: &PipelineConfig, position: u64, as_json: bool) -> anyhow::Result<Exit> {
    let mut found = None;
    // The messages up to the one asked for: the rest of the queue is not taken.
    let everything = Selection {
        limit: Some(position),
        ..Selection::default()
    };
    source::pass_dead_letters(pipeline, &everything, Action::Look, |letter| {
        if letter.position == position {
            found = Some(letter.clone());
        }
    })
    .await?;
    let Some(letter) = found else {
        eprintln!(
            "idem dlq show: {:?} holds no message #{position} (`idem dlq list` numbers them from 1, oldest first)",
            pipeline.dead_letter()
        );
        return Ok(Exit::Findings);
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&letter.json(true))?);
        return Ok(Exit::Success);
    }
    // Message content, and what the broker or a producer put in its headers, printed as
    // text that cannot drive the terminal.
    let text = |value: Option<&str>| printable(value.unwrap_or("-"), false);
    println!("#{} in {:?}", letter.position, pipeline.dead_letter());
    println!("kind         {}", text(letter.kind.as_deref()));
    println!("reason       {}", text(letter.reason.as_deref()));
    println!("age          {}", letter.age.map_or("-".into(), format_age));
    println!("replays      {}", letter.replays);
    println!(
        "message-id   {}",
        text(letter.message.message_id.as_deref())
    );
    println!("subject      {}", text(Some(&letter.message.subject)));
    println!("headers");
    for (name, value) in &letter.message.headers {
        println!("  {}: {}", text(Some(name)), text(Some(value)));
    }
    match std::str::from_utf8(&letter.message.body) {
        Ok(body) => println!(
            "body ({} bytes)\n{}",
            letter.message.body.len(),
            printable(body, true)
        ),
        Err(_) => println!(
            "body ({} bytes, not UTF-8, hex)\n{}",
            letter.message.body.len(),
            hex::encode(&letter.message.body)
        ),
    }
    Ok(Exit::Success)
}

async fn replay(
    pipeline: &PipelineConfig,
    selection: &Selection,
    dry_run: bool,
    format: FormatArg,
) -> anyhow::Result<Exit> {
    let verb = if dry_run { "would replay" } else { "replayed" };
    let pass = Pass {
        pipeline,
        action: Action::Replay,
        dry_run,
        json: format.is_json(),
    };
    let (moved, letters) = pass.run(selection, verb).await?;
    if pass.json {
        print_json(&serde_json::json!({
            "pipeline": pipeline.name,
            "from": pipeline.dead_letter(),
            "to": pipeline.queue(),
            "dry_run": dry_run,
            "replayed": moved,
            "letters": letters,
        }))?;
        return Ok(Exit::Success);
    }
    println!(
        "{verb} {moved} message(s) from {:?} to {:?}{}",
        pipeline.dead_letter(),
        pipeline.queue(),
        if dry_run {
            " (dry run: nothing moved)"
        } else {
            ""
        }
    );
    Ok(Exit::Success)
}

/// One pass of `action` (or, with `dry_run`, only a look) over a pipeline's dead letters.
struct Pass<'a> {
    pipeline: &'a PipelineConfig,
    action: Action,
    dry_run: bool,
    /// Collect the letters as JSON instead of printing a line for each.
    json: bool,
}

impl Pass<'_> {
    /// Runs the pass over the selected dead letters, printing a line for each
    /// (`<verb> #3 (kind: reason)`), or, for JSON, collecting them; how many it passed.
    async fn run(
        &self,
        selection: &Selection,
        verb: &str,
    ) -> anyhow::Result<(u64, Vec<serde_json::Value>)> {
        let action = if self.dry_run {
            Action::Look
        } else {
            self.action
        };
        let mut letters = Vec::new();
        let passed = source::pass_dead_letters(self.pipeline, selection, action, |letter| {
            if self.json {
                letters.push(letter.json(false));
                return;
            }
            println!(
                "{verb} #{} ({}: {})",
                letter.position,
                printable(letter.kind.as_deref().unwrap_or("-"), false),
                printable(
                    &cut_line(letter.reason.as_deref().unwrap_or("-"), 80),
                    false
                )
            );
        })
        .await?;
        Ok((passed, letters))
    }
}

async fn discard(
    pipeline: &PipelineConfig,
    filter: DlqFilter,
    all: bool,
    dry_run: bool,
    format: FormatArg,
) -> anyhow::Result<Exit> {
    let selection = filter.selection();
    if selection.is_everything() && !all {
        return Err(UsageError(format!(
            "idem dlq discard: no filter given; pass --kind, --reason, --since, --id or --limit, or --all to discard every dead letter of {:?}",
            pipeline.name
        ))
        .into());
    }
    let verb = if dry_run {
        "would discard"
    } else {
        "discarded"
    };
    let pass = Pass {
        pipeline,
        action: Action::Discard,
        dry_run,
        json: format.is_json(),
    };
    let (removed, letters) = pass.run(&selection, verb).await?;
    if pass.json {
        print_json(&serde_json::json!({
            "pipeline": pipeline.name,
            "from": pipeline.dead_letter(),
            "dry_run": dry_run,
            "discarded": removed,
            "letters": letters,
        }))?;
        return Ok(Exit::Success);
    }
    println!(
        "{verb} {removed} message(s) from {:?}{}",
        pipeline.dead_letter(),
        if dry_run {
            " (dry run: nothing removed)"
        } else {
            ""
        }
    );
    Ok(Exit::Success)
}

async fn archive(
    config: &Config,
    pipeline: &PipelineConfig,
    selection: &Selection,
    to: Option<&Path>,
    dry_run: bool,
) -> anyhow::Result<Exit> {
    let database_config = config.database_of(pipeline);
    let tables = Tables::of(database_config);
    let pool = match to {
        Some(_) => None,
        None => Some(database::connect_once(database_config).await?),
    };
    let target = match (&pool, to) {
        (_, Some(path)) => ArchiveTo::File(path),
        (Some(pool), None) => ArchiveTo::Table {
            pool,
            tables: &tables,
        },
        (None, None) => unreachable!("a pool is opened when no file is given"),
    };
    let report = triage::archive_dead_letters(pipeline, selection, target, dry_run).await?;
    if let Some(pool) = pool {
        pool.close().await;
    }
    let place = match to {
        Some(path) => path.display().to_string(),
        None => format!(
            "{} in {}",
            tables.archive(),
            idem_host::store::database::label(pipeline.database.as_deref())
        ),
    };
    if dry_run {
        println!(
            "would archive {} message(s) from {:?} to {place} (dry run: nothing written or removed)",
            report.archived.len(),
            pipeline.dead_letter()
        );
    } else {
        println!(
            "archived {} message(s) from {:?} to {place}; {} removed from {:?}",
            report.archived.len(),
            pipeline.dead_letter(),
            report.discarded,
            pipeline.dead_letter()
        );
    }
    Ok(Exit::Success)
}
