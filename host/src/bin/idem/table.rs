//! Plain-text tables, ages and message content as `idem dlq` and `idem outbox` print them to a
//! terminal.

use std::time::Duration;

/// Prints `rows` under `header`, each column as wide as its widest cell.
/// Cells are [`printable`]: they may hold message content.
pub fn print_table<const N: usize>(header: &[&str; N], rows: Vec<[String; N]>) {
    let rows: Vec<[String; N]> = rows
        .into_iter()
        .map(|row| row.map(|cell| printable(&cell, false)))
        .collect();
    let mut widths = header.map(|title| title.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (index, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if index + 1 == N {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<width$}  "));
            }
        }
        println!("{}", text.trim_end());
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// `text` safe to print to a terminal: every control character (escape sequences, carriage
/// returns, backspaces, the C1 set) and every bidirectional override written out as `\u{…}`,
/// so message content can neither drive the terminal nor hide or reorder what it shows. Line
/// breaks and tabs are kept when `lines`.
pub fn printable(text: &str, lines: bool) -> String {
    let mut shown = String::with_capacity(text.len());
    for character in text.chars() {
        let layout = lines && matches!(character, '\n' | '\t');
        let bidi = matches!(character, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if (character.is_control() && !layout) || bidi {
            shown.push_str(&format!("\\u{{{:x}}}", u32::from(character)));
        } else {
            shown.push(character);
        }
    }
    shown
}

/// An age as `45s`, `12m`, `3h05m` or `2d04h`.
pub fn format_age(age: Duration) -> String {
    let seconds = age.as_secs();
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86400 => format!("{}h{:02}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d{:02}h", seconds / 86400, seconds % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn message_content_cannot_drive_the_terminal() {
        assert_eq!(printable("plain text, é ü", false), "plain text, é ü");
        assert_eq!(
            printable("\u{1b}]52;c;cGF3bmVk\u{7}title\u{1b}[2J", false),
            "\\u{1b}]52;c;cGF3bmVk\\u{7}title\\u{1b}[2J"
        );
        assert_eq!(
            printable("a\rb\u{8}c\u{9b}d", false),
            "a\\u{d}b\\u{8}c\\u{9b}d"
        );
        assert_eq!(printable("line\n\tnext", true), "line\n\tnext");
        assert_eq!(printable("line\nnext", false), "line\\u{a}next");
        assert_eq!(printable("abc\u{202e}fed", true), "abc\\u{202e}fed");
    }
}
