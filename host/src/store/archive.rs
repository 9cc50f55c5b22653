//! Dead letters an operator archived before discarding them: rows of `idem_dead_letters`,
//! whole (headers and body), written and committed before the dead letters are removed.

use std::borrow::Cow;

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
            let headers: Vec<[Cow<'_, str>; 2]> = letter
                .headers
                .iter()
                .map(|(name, value)| [storable(name), storable(value)])
                .collect();
            bookkeeping::query(&tables.sql(
                "INSERT INTO {archive} \
                 (pipeline, dead_letter, error_kind, reason, message_id, subject, headers, body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            ))
            .bind(pipeline)
            .bind(storable(letter.dead_letter))
            .bind(letter.error_kind.map(storable))
            .bind(letter.reason.map(storable))
            .bind(letter.message_id.map(storable))
            .bind(storable(letter.subject))
            .bind(sqlx::types::Json(headers))
            .bind(letter.body)
            .execute(&mut *connection)
            .await?;
        }
        Ok(())
    })
    .await
}

/// `text` as PostgreSQL stores it in text and JSON: a NUL (which a producer's header or
/// routing key may hold, and which the server refuses) becomes U+FFFD, so one such dead
/// letter does not fail the whole archive. The body is kept byte for byte.
fn storable(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_is_replaced_and_nothing_else() {
        assert_eq!(storable("plain é"), "plain é");
        assert_eq!(storable("a\0b"), "a\u{fffd}b");
    }
}
