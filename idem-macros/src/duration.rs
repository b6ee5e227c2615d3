//! Durations written as `"90m"`, `"24h"`, `"7d"` or `"1h30m"`.

/// The longest duration accepted: 100 years of 365 days.
const MAX_SECONDS: u64 = 100 * 365 * 86_400;

/// Parses a duration into whole seconds.
pub fn parse_seconds(text: &str) -> Result<u64, String> {
    const HINT: &str =
        "write a number followed by `s`, `m`, `h` or `d`, e.g. \"90m\", \"24h\", \"7d\"";
    if text.is_empty() {
        return Err(format!("empty duration; {HINT}"));
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        if c == '.' {
            return Err(format!(
                "invalid duration `{text}`: fractions are not supported; use a smaller unit, e.g. \"90m\" for 1.5 hours"
            ));
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => {
                return Err(format!(
                    "invalid duration `{text}`: unknown unit `{c}`; {HINT}"
                ));
            }
        };
        if digits.is_empty() {
            return Err(format!(
                "invalid duration `{text}`: `{c}` has no number before it; {HINT}"
            ));
        }
        let amount: u64 = digits
            .parse()
            .map_err(|_| format!("invalid duration `{text}`: `{digits}` is too large"))?;
        total = amount
            .checked_mul(unit)
            .and_then(|s| total.checked_add(s))
            .ok_or_else(|| format!("invalid duration `{text}`: too large"))?;
        digits.clear();
    }
    if !digits.is_empty() {
        return Err(format!(
            "invalid duration `{text}`: `{digits}` has no unit; {HINT}"
        ));
    }
    if total == 0 {
        return Err(format!(
            "invalid duration `{text}`: must be longer than zero"
        ));
    }
    if total > MAX_SECONDS {
        return Err(format!(
            "invalid duration `{text}`: longer than 100 years; the database cannot date keys that far"
        ));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::parse_seconds;

    #[test]
    fn units_and_sums() {
        assert_eq!(parse_seconds("90m"), Ok(5400));
        assert_eq!(parse_seconds("24h"), Ok(86_400));
        assert_eq!(parse_seconds("7d"), Ok(604_800));
        assert_eq!(parse_seconds("1h30m"), Ok(5400));
        assert_eq!(parse_seconds("45s"), Ok(45));
    }

    #[test]
    fn bad_durations() {
        for bad in [
            "",
            "24",
            "h",
            "24x",
            "0h",
            "1.5h",
            " 24h",
            "-1h",
            "99999999999999999999d",
        ] {
            assert!(parse_seconds(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
