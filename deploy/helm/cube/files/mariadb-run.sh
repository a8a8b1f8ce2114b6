#!/bin/sh
# Starts the catalog's MariaDB (Debian's mariadbd, image cube/mariadb). On
# an empty data directory it first bootstraps the system tables (what
# mariadb-install-db does) and the catalog's database and user.
# Env: MARIADB_DATA, CUBE_DB, CUBE_DB_USER, CUBE_DB_PASSWORD, MARIADB_PORT.
set -eu
data="${MARIADB_DATA:-/var/lib/mysql}"
run="${MARIADB_RUN:-/run/mysqld}"
mkdir -p "$(dirname "$data")" "$run"
# No /tmp in the image: temporary files go to the run directory.
common="--no-defaults --datadir=$data --tmpdir=$run --user=root --skip-name-resolve --innodb-buffer-pool-size=64M --performance-schema=OFF --skip-log-bin"
if [ ! -d "$data/mysql" ]; then
  echo "bootstrapping $data"
  # Into a fresh directory renamed into place: a bootstrap that fails half
  # way is redone at the next start.
  rm -rf "$data.new"
  mkdir -p "$data.new"
  final="$data"
  data="$data.new"
  common=$(echo "$common" | sed "s#--datadir=$final #--datadir=$data #")
  share=/usr/share/mysql
  {
    echo "create database if not exists mysql;"
    echo "use mysql;"
    echo "SET @auth_root_socket='root';"
    cat "$share/mysql_system_tables.sql" "$share/mysql_performance_tables.sql" "$share/mysql_system_tables_data.sql"
  } | mariadbd $common --bootstrap >/dev/null
  rm -rf "$final"
  mv "$data" "$final"
  data="$final"
  common=$(echo "$common" | sed "s#--datadir=$data.new #--datadir=$data #")
  echo "bootstrapped"
fi
# The database and its user, at every start (idempotent; a changed
# password in the Secret takes effect on the next start).
pw=$(printf %s "$CUBE_DB_PASSWORD" | sed "s/'/''/g")
umask 077
cat > "$run/init.sql" <<SQL
CREATE DATABASE IF NOT EXISTS \`$CUBE_DB\`;
CREATE USER IF NOT EXISTS '$CUBE_DB_USER'@'%' IDENTIFIED BY '$pw';
ALTER USER '$CUBE_DB_USER'@'%' IDENTIFIED BY '$pw';
GRANT ALL PRIVILEGES ON \`$CUBE_DB\`.* TO '$CUBE_DB_USER'@'%';
SQL
exec mariadbd $common --init-file="$run/init.sql" --bind-address=0.0.0.0 --port="${MARIADB_PORT:-3306}" --socket="$run/mysqld.sock" --pid-file="$run/mysqld.pid"
