//! HTTP/1.1 by hand, over raw TCP: requests written byte for byte (repeated headers, invalid
//! bytes, broken framing) and answers read off the socket.

use super::*;

/// One HTTP/1.1 request, written by hand.
pub(super) struct Wire {
    pub(super) method: String,
    pub(super) target: String,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) body: Vec<u8>,
    pub(super) chunked: bool,
}

impl Wire {
    pub(super) fn new(method: &str, target: impl Into<String>) -> Self {
        Self {
            method: method.to_owned(),
            target: target.into(),
            headers: Vec::new(),
            body: Vec::new(),
            chunked: false,
        }
    }

    pub(super) fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    pub(super) fn tenant(self, tenant: &str) -> Self {
        self.header("Authorization", format!("Bearer {tenant}"))
    }

    pub(super) fn key(self, key: &str) -> Self {
        self.header("Idempotency-Key", key)
    }

    pub(super) fn json(self, body: impl Into<Vec<u8>>) -> Self {
        self.header("Content-Type", "application/json").body(body)
    }

    pub(super) fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    pub(super) fn bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
            self.method, self.target
        )
        .into_bytes();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        if self.chunked {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            for chunk in self.body.chunks(100_000) {
                out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                out.extend_from_slice(chunk);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
        } else {
            if !self.body.is_empty() || self.method == "POST" {
                out.extend_from_slice(
                    format!("Content-Length: {}\r\n", self.body.len()).as_bytes(),
                );
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&self.body);
        }
        out
    }
}

pub(super) fn wire_target_has_query(wire: &Wire) -> bool {
    wire.target.contains('?')
}

/// An answer, read off the socket.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
}

impl Answer {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub(super) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// Parses `buf` as one response, if it holds a whole one (`eof`: nothing more will come).
pub(super) fn parse_answer(buf: &[u8], head: bool, eof: bool) -> Result<Option<Answer>, String> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if eof {
            Err(format!(
                "the connection closed after {} bytes, before a whole response head: {:?}",
                buf.len(),
                String::from_utf8_lossy(buf)
            ))
        } else {
            Ok(None)
        };
    };
    let head_text = String::from_utf8_lossy(&buf[..end]);
    let mut lines = head_text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &buf[end + 4..];
    let find = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let body = if head || status == 204 || status == 304 {
        Some(Vec::new())
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)
    } else if let Some(length) = find("content-length") {
        let length: usize = length.parse().map_err(|_| "bad content-length")?;
        (rest.len() >= length).then(|| rest[..length].to_vec())
    } else {
        eof.then(|| rest.to_vec())
    };
    match body {
        Some(body) => Ok(Some(Answer {
            status,
            headers,
            body,
        })),
        None if eof => Err(format!(
            "the connection closed inside the body of a {status}"
        )),
        None => Ok(None),
    }
}

pub(super) fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        if rest.len() < size + 2 {
            return None;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// Sends `wire` on a fresh connection and reads one response. The request is written while
/// the response is read, so a server that answers before reading a large body is seen as it
/// answers; the write half is kept open until then (a half-close would end the request).
pub(super) async fn exchange(
    addr: SocketAddr,
    wire: Vec<u8>,
    head: bool,
) -> Result<Answer, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut reader, mut writer) = stream.into_split();
    let sending = tokio::spawn(async move {
        let written = writer.write_all(&wire).await;
        (writer, written)
    });
    let mut buf = Vec::new();
    let mut chunk = vec![0_u8; 64 * 1024];
    let deadline = Instant::now() + idem_tests::DEADLINE;
    let answer = loop {
        if let Some(answer) = parse_answer(&buf, head, false)? {
            break answer;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, reader.read(&mut chunk)).await {
            Err(_) => {
                return Err(format!(
                    "no whole response in {:?} ({} bytes)",
                    idem_tests::DEADLINE,
                    buf.len()
                ));
            }
            Ok(Ok(0)) => {
                break parse_answer(&buf, head, true)?.ok_or("closed without a response")?;
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(error)) => {
                return Err(format!(
                    "read failed after {} bytes: {error}; {:?}",
                    buf.len(),
                    String::from_utf8_lossy(&buf[..buf.len().min(200)])
                ));
            }
        }
    };
    sending.abort();
    Ok(answer)
}
