"""token lifecycle: scope and expiry of API tokens

``scope`` is one of ingest | read | admin (admin ⊇ ingest, read). Tokens created before this
migration could do everything, so they become ``admin``: nothing a deployment did stops working;
new tokens default to ``ingest``. ``expires_at`` is optional; ``last_used_at`` already existed.

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('api_tokens', sa.Column('scope', sa.String(length=16), server_default='admin', nullable=False))
    op.alter_column('api_tokens', 'scope', server_default='ingest')
    op.create_check_constraint(op.f('ck_api_tokens_scope'), 'api_tokens', "scope IN ('ingest', 'read', 'admin')")
    op.add_column('api_tokens', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f('ix_api_tokens_name'), 'api_tokens', ['name'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_api_tokens_name'), table_name='api_tokens')
    op.drop_column('api_tokens', 'expires_at')
    op.drop_constraint(op.f('ck_api_tokens_scope'), 'api_tokens', type_='check')
    op.drop_column('api_tokens', 'scope')
