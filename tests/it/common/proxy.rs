//! A TCP proxy between the gateway and PostgreSQL whose link can be cut and restored,
//! to test how the gateway behaves when the database goes away.

use std::net::SocketAddr;

use tokio::{
    io::copy_bidirectional,
    net::{TcpListener, TcpStream},
    sync::watch,
};

pub struct TcpProxy {
    pub address: SocketAddr,
    cut: watch::Sender<bool>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let address = listener.local_addr().expect("proxy address");
        let (cut, cut_watch) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if *cut_watch.borrow() {
                    drop(inbound);
                    continue;
                }
                let mut cut_watch = cut_watch.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_watch.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        TcpProxy { address, cut }
    }

    /// Drops every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn restore(&self) {
        self.cut.send_replace(false);
    }

    /// A database URL that goes through this proxy.
    pub fn database_url(&self, database: &str) -> String {
        format!("postgres://postgres@{}/{database}", self.address)
    }
}
