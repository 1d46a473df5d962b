//! Throwaway `redis-server` instances on free loopback ports, killed when dropped: a single
//! node (optionally with a password or TLS) and a 3-master Redis Cluster. Shared by the
//! store's tests and the end-to-end tests (included by path there).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server` child process (no persistence).
pub struct RedisServer {
    child: Option<Child>,
    /// The address commands and readiness checks use (the first one bound).
    host: String,
    port: u16,
    password: Option<String>,
    tls: bool,
    /// The CA that signed its certificate (TLS only), for `redis-cli`.
    ca: Option<PathBuf>,
    /// Cluster config file, TLS files: removed with the server.
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    let [p] = free_ports();
    p
}

/// `N` distinct free loopback ports (held together while picked, so never the same).
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("binding a free loopback port"))
        .collect();
    std::array::from_fn(|i| {
        held[i]
            .local_addr()
            .expect("a bound listener has an address")
            .port()
    })
}

/// A loopback URL where nothing listens (a port just freed).
pub fn dead_url() -> String {
    format!("redis://127.0.0.1:{}", free_port())
}

/// Runs a set-up tool, panicking with its output when it fails.
fn run_tool(cmd: &mut Command) -> String {
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "{cmd:?} is not installed, and the remote-tier tests need it: run \
             `bash scripts/setup.sh` as root (it installs Debian's redis-server and openssl)"
        ),
        Err(e) => panic!("running {cmd:?}: {e}"),
    };
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A CA and a server certificate for 127.0.0.1 made with `openssl` (PEM files).
pub struct TestCerts {
    /// The CA certificate clients trust.
    pub ca: PathBuf,
    /// The server's certificate (subjectAltName IP:127.0.0.1).
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

impl TestCerts {
    /// Generates them under `dir`.
    pub fn generate(dir: &Path) -> TestCerts {
        let p = |n: &str| dir.join(n);
        let s = |p: &PathBuf| p.to_string_lossy().into_owned();
        let (ca, ca_key, cert, key, csr, ext) = (
            p("ca.crt"),
            p("ca.key"),
            p("server.crt"),
            p("server.key"),
            p("server.csr"),
            p("san.ext"),
        );
        run_tool(Command::new("openssl").args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=kvstore test CA",
            "-keyout",
            &s(&ca_key),
            "-out",
            &s(&ca),
        ]));
        run_tool(Command::new("openssl").args([
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            &s(&key),
            "-out",
            &s(&csr),
        ]));
        std::fs::write(&ext, "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
        run_tool(Command::new("openssl").args([
            "x509",
            "-req",
            "-in",
            &s(&csr),
            "-CA",
            &s(&ca),
            "-CAkey",
            &s(&ca_key),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &s(&ext),
            "-out",
            &s(&cert),
        ]));
        TestCerts { ca, cert, key }
    }
}

/// How to start a server.
#[derive(Default)]
pub struct ServerOptions<'a> {
    /// `--requirepass`.
    pub password: Option<&'a str>,
    /// Serve TLS only (no plain port) with these certificates.
    pub tls: Option<&'a TestCerts>,
    /// `--cluster-enabled yes`.
    pub cluster: bool,
    /// Addresses to listen on instead of 127.0.0.1 (the first one is used to talk to it).
    pub bind: &'a [&'a str],
}

impl RedisServer {
    /// Starts a plain one; panics with set-up instructions when `redis-server` is missing.
    pub fn start() -> RedisServer {
        RedisServer::start_with(ServerOptions::default())
    }

    /// Starts one with `opts`, and waits until it answers.
    pub fn start_with(opts: ServerOptions<'_>) -> RedisServer {
        let [port, bus_port] = free_ports();
        let dir = tempfile::tempdir().expect("a temporary directory for redis-server");
        let bind = if opts.bind.is_empty() {
            &["127.0.0.1"][..]
        } else {
            opts.bind
        };
        let mut cmd = Command::new("redis-server");
        cmd.current_dir(dir.path())
            .arg("--bind")
            .args(bind)
            .args(["--save", "", "--appendonly", "no"])
            .args(["--maxmemory-policy", "allkeys-lru"]);
        match opts.tls {
            None => cmd.args(["--port", &port.to_string()]),
            Some(c) => cmd
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .arg("--tls-cert-file")
                .arg(&c.cert)
                .arg("--tls-key-file")
                .arg(&c.key)
                .arg("--tls-ca-cert-file")
                .arg(&c.ca)
                .args(["--tls-auth-clients", "no"]),
        };
        if let Some(pw) = opts.password {
            cmd.args(["--requirepass", pw]);
        }
        if opts.cluster {
            // The bus port would default to port + 10000: past 65535 for high free ports,
            // and 10000 for every TLS-only node (port 0).
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-port", &bus_port.to_string()]);
            if opts.tls.is_some() {
                cmd.args(["--tls-cluster", "yes"]);
            }
        }
        let child = match cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed, and the remote-tier tests need it: \
                 run `bash scripts/setup.sh` as root (it installs Debian's redis-server)"
            ),
            Err(e) => panic!("starting redis-server: {e}"),
        };
        let server = RedisServer {
            child: Some(child),
            host: bind[0].to_string(),
            port,
            password: opts.password.map(str::to_string),
            tls: opts.tls.is_some(),
            ca: opts.tls.map(|c| c.ca.clone()),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        // A TLS port cannot be spoken to in plain text: a TCP accept is enough there.
        let ready = |s: &RedisServer| match s.tls {
            true => TcpStream::connect((s.host.as_str(), s.port)).is_ok(),
            false => s
                .try_command(&[b"PING"])
                .is_ok_and(|r| r.starts_with(b"+PONG")),
        };
        while !ready(&server) {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer on port {port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://<first address>:<port>` (`rediss://` with TLS), with the password if any.
    pub fn url(&self) -> String {
        let host = &self.host;
        let scheme = if self.tls { "rediss" } else { "redis" };
        match &self.password {
            Some(pw) => format!("{scheme}://:{pw}@{host}:{}", self.port),
            None => format!("{scheme}://{host}:{}", self.port),
        }
    }

    /// Sends one command (after AUTH when the server has a password) and returns the raw
    /// reply (one read; enough for short replies). Not for TLS servers.
    pub fn command(&self, args: &[&[u8]]) -> Vec<u8> {
        self.try_command(args).expect("talking to redis-server")
    }

    fn try_command(&self, args: &[&[u8]]) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect((self.host.as_str(), self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut req = Vec::new();
        let auth: Vec<&[u8]>;
        let mut cmds = Vec::new();
        if let Some(pw) = &self.password {
            auth = vec![b"AUTH", pw.as_bytes()];
            cmds.push(auth.as_slice());
        }
        cmds.push(args);
        for args in &cmds {
            req.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for a in *args {
                req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                req.extend_from_slice(a);
                req.extend_from_slice(b"\r\n");
            }
        }
        s.write_all(&req)?;
        let mut buf = vec![0u8; 4096];
        let mut n = s.read(&mut buf)?;
        if self.password.is_some() {
            // Skip AUTH's `+OK\r\n`; read the command's reply if it came separately.
            if n <= 5 {
                n = s.read(&mut buf)?;
                buf.truncate(n);
                return Ok(buf);
            }
            buf.drain(..5);
            n -= 5;
        }
        buf.truncate(n);
        Ok(buf)
    }

    /// `redis-cli` set up to talk to this server (port, TLS, password).
    pub fn cli(&self) -> Command {
        let mut c = Command::new("redis-cli");
        c.args(["-h", &self.host, "-p", &self.port.to_string()]);
        if let Some(ca) = &self.ca {
            c.arg("--tls").arg("--cacert").arg(ca);
        }
        if let Some(pw) = &self.password {
            c.args(["--no-auth-warning", "-a", pw]);
        }
        c
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of masters without replicas, all slots assigned, on loopback.
pub struct RedisCluster {
    /// The masters, in the order given to `redis-cli --cluster create`.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` (at least 3) nodes, joins them with `redis-cli --cluster create`
    /// and waits for `cluster_state:ok` on every node.
    pub fn start(masters: usize) -> RedisCluster {
        RedisCluster::start_with(masters, None)
    }

    /// As [`RedisCluster::start`], every node (and the cluster bus) on TLS with `tls`.
    pub fn start_with(masters: usize, tls: Option<&TestCerts>) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                RedisServer::start_with(ServerOptions {
                    cluster: true,
                    tls,
                    ..ServerOptions::default()
                })
            })
            .collect();
        let mut create = nodes[0].cli();
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        run_tool(&mut create);
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &nodes {
            while !run_tool(n.cli().args(["CLUSTER", "INFO"])).contains("cluster_state:ok") {
                assert!(
                    Instant::now() < deadline,
                    "the Redis Cluster did not reach cluster_state:ok within 20 s"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes }
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,…` (`rediss+cluster` with TLS).
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let scheme = if self.nodes[0].tls {
            "rediss+cluster"
        } else {
            "redis+cluster"
        };
        format!("{scheme}://{}", seeds.join(","))
    }

    /// Keys held by each master (`DBSIZE`).
    pub fn keys_per_node(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .map(|n| {
                let r = n.command(&[b"DBSIZE"]);
                String::from_utf8_lossy(&r)
                    .trim()
                    .trim_start_matches(':')
                    .parse()
                    .expect("DBSIZE replies an integer")
            })
            .collect()
    }
}
