//! Durations written as `"90m"`, `"24h"`, `"7d"` or `"1h30m"`.

/// The longest duration accepted: 100 years of 365 days.
const MAX_SECONDS: u64 = 100 * 365 * 86_400;

/// How to write a duration, for the errors.
const HINT: &str = "write a number followed by `s`, `m`, `h` or `d`, e.g. \"90m\", \"24h\", \"7d\"";

/// Parses a duration into whole seconds: groups of digits each followed by its unit, summed.
pub fn parse_seconds(text: &str) -> Result<u64, String> {
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
        let unit = unit_seconds(text, c)?;
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
    check_total(text, total)
}

/// The seconds in the unit `c` of `text`, or why `c` is not a unit.
fn unit_seconds(text: &str, c: char) -> Result<u64, String> {
    match c {
        's' => Ok(1),
        'm' => Ok(60),
        'h' => Ok(3600),
        'd' => Ok(86_400),
        '.' => Err(format!(
            "invalid duration `{text}`: fractions are not supported; use a smaller unit, e.g. \"90m\" for 1.5 hours"
        )),
        _ => Err(format!(
            "invalid duration `{text}`: unknown unit `{c}`; {HINT}"
        )),
    }
}

/// `total` seconds, if longer than zero and at most [`MAX_SECONDS`].
fn check_total(text: &str, total: u64) -> Result<u64, String> {
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

    mod properties {
        use super::super::{MAX_SECONDS, parse_seconds};
        use proptest::prelude::*;

        const UNITS: [(char, u128); 4] = [('s', 1), ('m', 60), ('h', 3600), ('d', 86_400)];

        /// The documented grammar, written independently: one or more `<digits><unit>` groups
        /// with units `s`, `m`, `h`, `d` in any order ("combinable"), a total above zero and
        /// at most 100 years. Computed in `u128`, so no overflow can hide an error.
        fn model(text: &str) -> Option<u64> {
            let mut total: u128 = 0;
            let mut rest = text;
            if rest.is_empty() {
                return None;
            }
            while !rest.is_empty() {
                let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
                let unit_char = rest[digits..].chars().next()?;
                let (_, unit) = UNITS.iter().find(|(c, _)| *c == unit_char)?;
                if digits == 0 {
                    return None;
                }
                let amount: u128 = rest[..digits].parse().ok()?;
                total = total.checked_add(amount.checked_mul(*unit)?)?;
                rest = &rest[digits + 1..];
            }
            (1..=u128::from(MAX_SECONDS))
                .contains(&total)
                .then(|| u64::try_from(total).unwrap())
        }

        fn unit() -> impl Strategy<Value = (char, u128)> {
            prop::sample::select(&UNITS[..])
        }

        fn amount() -> impl Strategy<Value = u128> {
            prop_oneof![
                8 => 0u128..1000,
                2 => 0u128..=5_000_000_000,
                1 => Just(36_500),
                1 => Just(u128::from(u64::MAX)),
                1 => u128::from(u64::MAX)..=u128::from(u64::MAX) + 10,
            ]
        }

        /// Valid groups: amounts with units, written with or without leading zeros.
        fn groups() -> impl Strategy<Value = Vec<(u128, char, u128, usize)>> {
            prop::collection::vec(
                (amount(), unit(), 0usize..3).prop_map(|(n, (c, u), zeros)| (n, c, u, zeros)),
                1..=5,
            )
        }

        fn render(groups: &[(u128, char, u128, usize)]) -> String {
            groups
                .iter()
                .map(|(n, c, _, zeros)| format!("{}{n}{c}", "0".repeat(*zeros)))
                .collect()
        }

        /// Characters outside the grammar, and grammar characters in the wrong place.
        fn foreign() -> impl Strategy<Value = char> {
            prop_oneof![
                prop::sample::select(
                    &[
                        ' ', '.', '-', '+', ',', '_', 'S', 'H', 'w', 'y', 'µ', '٣', '１', 'ｓ',
                        '\u{0}', '\n', '😀'
                    ][..]
                ),
                any::<char>().prop_filter("outside the alphabet", |c| {
                    !c.is_ascii_digit() && !"smhd".contains(*c)
                }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2048))]

            #[test]
            fn parse_seconds_never_panics_on_arbitrary_strings(text in any::<String>()) {
                let _ = parse_seconds(&text);
            }

            #[test]
            fn parse_seconds_agrees_with_the_grammar(
                text in prop_oneof![
                    "[0-9smhd]{0,12}",
                    "[0-9smhd .x-]{0,12}",
                    "[0-9]{15,25}[smhd]",
                    any::<String>(),
                ],
            ) {
                let got = parse_seconds(&text);
                prop_assert_eq!(got.as_ref().ok().copied(), model(&text), "{:?}: {:?}", text, got);
                if let Err(message) = got {
                    prop_assert!(!message.is_empty());
                }
            }

            #[test]
            fn parse_seconds_returns_the_sum_of_valid_groups(groups in groups()) {
                let text = render(&groups);
                let sum = groups.iter().try_fold(0u128, |sum, (n, _, u, _)| {
                    sum.checked_add(n.checked_mul(*u)?)
                });
                let expected = sum
                    .filter(|s| (1..=u128::from(MAX_SECONDS)).contains(s))
                    .map(|s| u64::try_from(s).unwrap());
                prop_assert_eq!(parse_seconds(&text).ok(), expected, "{}", text);
            }

            #[test]
            fn parse_seconds_refuses_strings_outside_the_grammar(
                groups in groups(),
                at in any::<prop::sample::Index>(),
                how in 0u8..4,
                foreign in foreign(),
                (stray_unit, _) in unit(),
            ) {
                let valid = render(&groups);
                let mut chars: Vec<char> = valid.chars().collect();
                let at = at.index(chars.len() + 1);
                match how {
                    // A character that the grammar does not have, anywhere.
                    0 => chars.insert(at, foreign),
                    // The last group without its unit.
                    1 => { chars.pop(); }
                    // A unit with no number before it: at the start or after another unit.
                    2 => {
                        let after_unit = (0..=chars.len())
                            .filter(|&i| i == 0 || !chars[i - 1].is_ascii_digit())
                            .nth(at % (groups.len() + 1))
                            .unwrap_or(0);
                        chars.insert(after_unit, stray_unit);
                    }
                    // The grammar's units in upper case.
                    _ => {
                        for c in &mut chars {
                            *c = c.to_ascii_uppercase();
                        }
                    }
                }
                let text: String = chars.into_iter().collect();
                prop_assert!(parse_seconds(&text).is_err(), "{:?} was accepted", text);
            }
        }
    }
}
