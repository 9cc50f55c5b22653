//! Dead letters an operator archived before discarding them: rows of `idem_dead_letters`,
//! whole (headers and body), written and committed before the dead letters are removed.

use sqlx::PgPool;

use crate::store::bookkeeping;
use crate::store::tables::Tables;

/// One dead letter as it is archived.
#[derive(Debug, Clone, Copy)]
pub struct Archived<'a> {
    /// Its id in the dead-letter queue or stream.
    pub dead_letter: &'a str,
    pub error_kind: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub message_id: Option<&'a str>,
    pub subject: &'a str,
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// Writes `letters` of pipeline `pipeline` to the archive, in one transaction.
pub async fn write(
    pool: &PgPool,
    tables: &Tables,
    pipeline: &str,
    letters: &[Archived<'_>],
) -> Result<(), sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        for letter in letters {
            let headers: Vec<[&str; 2]> = letter
                .headers
                .iter()
                .map(|(name, value)| [name.as_str(), value.as_str()])
                .collect();
            bookkeeping::query(&tables.sql(
                "INSERT INTO {archive} \
                 (pipeline, dead_letter, error_kind, reason, message_id, subject, headers, body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            ))
            .bind(pipeline)
            .bind(letter.dead_letter)
            .bind(letter.error_kind)
            .bind(letter.reason)
            .bind(letter.message_id)
            .bind(letter.subject)
            .bind(sqlx::types::Json(headers))
            .bind(letter.body)
            .execute(&mut *connection)
            .await?;
        }
        Ok(())
    })
    .await
}
